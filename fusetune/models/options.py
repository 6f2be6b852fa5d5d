"""Which of fusetune's kernels a patch uses: below both the recognizer and the patching that calls it."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class PatchOptions:
    """Which kernels to use. Every option defaults to on; turn one off to compare or to bisect."""

    rope: bool = True
    rms_norm: bool = True
    swiglu: bool = True
    geglu: bool = True
    # The middle residual add of each decoder layer fused into the following RMSNorm; needs rms_norm.
    add_rms_norm: bool = True
    fused_linear_cross_entropy: bool = True
    # A built model on sdpa attention switches to "fusetune_varlen" (models/attention.py): packed and padded
    # rows whose sequence boundaries are passed attend within each sequence without a mask.
    varlen_attention: bool = True

    @classmethod
    def names(cls) -> frozenset[str]:
        return frozenset(option.name for option in fields(cls))

"""Fused Triton kernels for training causal language models.

Each op lives in its own module with its Triton kernels, launcher, autograd function, torch.library
registration (so ``torch.compile(fullgraph=True)`` traces through it), a pure-PyTorch ``*_reference`` and the
``nn.Module`` drop-ins for the Hugging Face layers. This package imports nothing else of fusetune.

The functions named like their module (``rms_norm``, ``layer_norm``, ``swiglu``, ``cross_entropy``,
``fused_linear_cross_entropy``) are not re-exported here: ``fusetune.kernels.rms_norm`` stays the module, so
``from fusetune.kernels import rms_norm`` and ``import fusetune.kernels.rms_norm as m`` mean one thing. Import
those functions from their modules (``from fusetune.kernels.rms_norm import rms_norm``).
"""

from fusetune.kernels.adamw import (
    FusedAdamW,
    adamw_state_bytes_per_parameter,
    adamw_step_reference,
    gradient_clipping_scale,
)
from fusetune.kernels.adamw8bit import (
    FusedAdamW8bit,
    adamw8bit_state_bytes_per_parameter,
    adamw8bit_step_reference,
)
from fusetune.kernels.cross_entropy import FusedCrossEntropyLoss, cross_entropy_reference
from fusetune.kernels.fused_linear_cross_entropy import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy_reference,
)
from fusetune.kernels.layer_norm import FusedLayerNorm, layer_norm_reference
from fusetune.kernels.rms_norm import (
    FusedRMSNorm,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm_reference,
)
from fusetune.kernels.rope import apply_rotary_pos_emb, rope_reference
from fusetune.kernels.swiglu import (
    FusedGeGLUMLP,
    FusedSwiGLUMLP,
    geglu,
    geglu_reference,
    swiglu_reference,
)

__all__ = [
    "FusedAdamW",
    "FusedAdamW8bit",
    "FusedCrossEntropyLoss",
    "FusedGeGLUMLP",
    "FusedLayerNorm",
    "FusedLinearCrossEntropyLoss",
    "FusedRMSNorm",
    "FusedSwiGLUMLP",
    "add_rms_norm",
    "add_rms_norm_reference",
    "adamw8bit_state_bytes_per_parameter",
    "adamw8bit_step_reference",
    "adamw_state_bytes_per_parameter",
    "adamw_step_reference",
    "apply_rotary_pos_emb",
    "cross_entropy_reference",
    "fused_linear_cross_entropy_reference",
    "geglu",
    "geglu_reference",
    "gradient_clipping_scale",
    "layer_norm_reference",
    "rms_norm_reference",
    "rope_reference",
    "swiglu_reference",
]

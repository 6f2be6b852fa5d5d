"""The cross-entropy kernel of this checkout against other versions of its file (an earlier commit's, or
variants under trial), all in one process: fwd+bwd through torch.autograd.grad (the gradient written over
the logits, as benchmarks/kernels/ops.py times it) and the loss alone (no gradient: the kernel's first sweep),
do_bench medians, each version timed twice in turn so that drift shows.

    git show REV:fusetune/kernels/cross_entropy.py > /tmp/ce_before.py
    python3 -m benchmarks.kernels.cross_entropy_ab /tmp/ce_before.py [/tmp/ce_variant.py ...] [--out DIR]

Each other file's custom ops are renamed on load so that every version can be registered at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

# (T, V, softcaps)
SHAPES = (
    (8192, 128256, (None,)),
    (8192, 256000, (None, 30.0)),
    (8192, 151936, (None,)),
    (16384, 65536, (None,)),
    (8192, 32000, (None,)),
)


def load_version(path: Path, index: int):
    name = f"cross_entropy_version{index}"
    source = path.read_text().replace('"fusetune::', f'"fusetune_version{index}::')
    renamed = Path(tempfile.mkdtemp()) / f"{name}.py"
    renamed.write_text(source)
    spec = importlib.util.spec_from_file_location(name, renamed)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "others", type=Path, nargs="+", help="other versions of fusetune/kernels/cross_entropy.py"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    from triton.testing import do_bench

    import fusetune.kernels.cross_entropy as this

    versions = {"this checkout": this}
    versions.update({path.name: load_version(path, i) for i, path in enumerate(args.others)})
    rows = []
    for tokens, vocab, softcaps in SHAPES:
        torch.manual_seed(0)
        logits = (torch.randn(tokens, vocab, device="cuda") * 4).to(torch.bfloat16)
        labels = torch.randint(0, vocab, (tokens,), device="cuda")
        floor_ms = 2 * logits.numel() * logits.element_size() / 3.0e9  # read once, written once, at 3 TB/s
        for softcap in softcaps:
            for mode in ("fwd+bwd", "loss"):
                times: dict[str, list[float]] = {name: [] for name in versions}
                for _ in range(2):
                    for name, module in versions.items():
                        x = logits.clone().requires_grad_(mode == "fwd+bwd")

                        def fwd_bwd(module=module, x=x, labels=labels, softcap=softcap):
                            loss = module.cross_entropy(x, labels, softcap=softcap, inplace_backward=True)
                            return torch.autograd.grad([loss], [x])

                        def loss_only(module=module, x=x, labels=labels, softcap=softcap):
                            return module.cross_entropy(x, labels, softcap=softcap)

                        try:
                            fn = fwd_bwd if mode == "fwd+bwd" else loss_only
                            times[name].append(do_bench(fn, warmup=25, rep=200, return_mode="median"))
                        except Exception as error:  # a variant under trial that does not compile: say so
                            print(f"  {name}: {type(error).__name__}: {str(error)[:200]}")
                            times[name].append(float("nan"))
                        del x
                floor = floor_ms if mode == "fwd+bwd" else floor_ms / 2
                print(f"T={tokens} V={vocab} softcap={softcap} {mode} (floor at 3 TB/s {floor:.3f} ms):")
                for name, measured in times.items():
                    print(f"  {name:40s} " + "  ".join(f"{ms:.3f}" for ms in measured) + " ms")
                    rows.append(
                        {
                            "T": tokens,
                            "V": vocab,
                            "softcap": softcap,
                            "mode": mode,
                            "version": name,
                            "ms": measured,
                        }
                    )
    with open(os.path.join(args.out, "cross-entropy-ab.json"), "w") as handle:
        json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The cross-entropy kernel of this checkout against an earlier version of its file, in one process, with and
without a softcap (fwd+bwd through torch.autograd.grad, do_bench medians, each version timed twice).

    git show REV:fusetune/kernels/cross_entropy.py > /tmp/ce_before.py
    PYTHONPATH=. python3 benchmarks/cross_entropy_ab.py --before /tmp/ce_before.py

The earlier file's custom ops are renamed on load so that both versions can be registered at once.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

SHAPES = ((8192, 256000), (8192, 128256))


def load_before(path: Path):
    source = path.read_text().replace('"fusetune::', '"fusetune_before::')
    renamed = Path(tempfile.mkdtemp()) / "cross_entropy_before.py"
    renamed.write_text(source)
    spec = importlib.util.spec_from_file_location("cross_entropy_before", renamed)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", type=Path, required=True, help="an earlier fusetune/kernels/cross_entropy.py"
    )
    args = parser.parse_args()
    from triton.testing import do_bench

    import fusetune.kernels.cross_entropy as after

    before = load_before(args.before)
    for tokens, vocab in SHAPES:
        torch.manual_seed(0)
        logits = (torch.randn(tokens, vocab, device="cuda") * 4).to(torch.bfloat16)
        labels = torch.randint(0, vocab, (tokens,), device="cuda")
        for softcap in (30.0, None):
            times = {}
            for name, module in (
                ("before", before),
                ("after", after),
                ("before again", before),
                ("after again", after),
            ):
                x = logits.clone().requires_grad_()

                def fwd_bwd(module=module, x=x, labels=labels, softcap=softcap):
                    return torch.autograd.grad([module.cross_entropy(x, labels, softcap=softcap)], [x])

                times[name] = do_bench(fwd_bwd, warmup=25, rep=200, return_mode="median")
            print(
                f"T={tokens} V={vocab} softcap={softcap}: "
                + ", ".join(f"{k} {v:.3f} ms" for k, v in times.items())
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

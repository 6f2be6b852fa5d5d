"""Run a script in a fresh process without the Triton interpreter, against Hopper's target but no GPU: Triton
kernels are then compiled functions that the compiler can trace and analyse (not launch), which is all a test of
what torch.compile makes of them needs. The interpreter, which the rest of the suite runs under, cannot do this:
it launches a kernel even on the compiler's fake tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

# Put first in every script: the active driver then answers Hopper's target.
PRELUDE = """
import triton
from triton.backends.compiler import GPUTarget


class Hopper:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


triton.runtime.driver.set_active(Hopper())
"""


def run_on_hopper_target(script: str, timeout_s: float = 300) -> object:
    """The JSON value the script prints on its last line; the script's stderr in the failure message."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])

"""`python -m tests.worker.bf16_sr_train --config job.json` under torchrun: the trainer's entry point with the
bf16-sr precision modes allowed on this CPU, as conftest.py's `bf16_sr_on_cpu` allows them in the test process
(their optimizers' Triton kernels run under the interpreter here: TRITON_INTERPRET=1, which the tests set and
the ranks inherit)."""

import dataclasses
import os
import sys

from fusetune.spec import precision
from fusetune.worker.train import __main__ as entry

for name in ("bf16-sr", "bf16-sr-8bit"):
    precision.PRECISIONS[name] = dataclasses.replace(precision.PRECISIONS[name], needs_gpu=False)

if __name__ == "__main__":
    status = entry.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as the trainer's own entry point: nothing left to tear down

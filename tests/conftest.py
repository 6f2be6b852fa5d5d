"""Test-wide setup.

Without a GPU the Triton kernels run under the interpreter; the variable must be set before triton is
imported anywhere, which is why it is set here, at the top of the first module pytest imports.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if _HAS_CUDA else "cpu"


# The numerical tests whose arithmetic goes through the CPU's math libraries: the fused linear cross-entropy and
# the sequence log-probs (their chunks' matmuls run in torch), the models' patched-against-unpatched runs and the
# trainer's equivalence tests (these modules, and tests marked `numerics` one by one in
# tests/worker/test_train_trainer.py). `make test-numerics-narrow` runs them (`-m numerics`) a second time on the
# CPU's AVX2 code paths, which sum in another order than AVX-512 and AMX. The other kernel tests are not in it:
# under the interpreter a Triton kernel's arithmetic is numpy's, which those variables do not steer, and the
# bounds beside their TOLERANCES sit far above what another summation order moves a float32 reference.
NUMERICS = (
    "tests/kernels/test_fused_linear_cross_entropy.py",
    "tests/kernels/test_fused_linear_cross_entropy_skip.py",
    "tests/kernels/test_sequence_log_probs.py",
    "tests/models/test_convergence.py",
    "tests/worker/test_train_dpo.py",
    "tests/worker/test_train_simpo.py",
    "tests/worker/test_token_accuracy.py",
)


def pytest_collection_modifyitems(config, items):
    root = config.rootpath
    for item in items:
        if item.path.relative_to(root).as_posix().startswith(NUMERICS):
            item.add_marker(pytest.mark.numerics)
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def device() -> str:
    return DEVICE

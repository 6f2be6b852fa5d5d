"""Every kernel test runs with uninitialised memory poisoned: torch.empty and its kin come back filled with NaN
(floating point) or the largest integer. A kernel or launcher that reads memory it never wrote then gives NaN
or a wild index in the test, every time, instead of a result that depends on what the allocator's previous
owner left there (which passed on one machine and failed on another)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def poisoned_uninitialised_memory():
    # fill_uninitialized_memory acts only while deterministic algorithms are on; warn_only keeps the ops that
    # have no deterministic implementation running (with a warning) rather than raising.
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_filling
    torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)

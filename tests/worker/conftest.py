"""Fixtures shared by the worker and trainer tests."""

import dataclasses

import pytest


@pytest.fixture
def bf16_sr_on_cpu(monkeypatch):
    """The bf16-sr precision modes on this CPU: their optimizers' Triton kernels run under the interpreter here."""
    from fusetune.spec import precision

    for name in ("bf16-sr", "bf16-sr-8bit"):
        entry = dataclasses.replace(precision.PRECISIONS[name], needs_gpu=False)
        monkeypatch.setitem(precision.PRECISIONS, name, entry)

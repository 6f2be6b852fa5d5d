"""Fixtures shared by the worker and trainer tests."""

import dataclasses

import pytest


@pytest.fixture
def bf16_sr_on_cpu(monkeypatch):
    """The bf16-sr precision mode on this CPU: its optimizer's Triton kernel runs under the interpreter here."""
    from fusetune.spec import precision

    entry = dataclasses.replace(precision.PRECISIONS["bf16-sr"], needs_gpu=False)
    monkeypatch.setitem(precision.PRECISIONS, "bf16-sr", entry)

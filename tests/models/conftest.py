"""Every test here must leave transformers as it found it: no class or module patch may outlive a test."""

import importlib
from collections import Counter

import pytest

from fusetune.models import patching


@pytest.fixture(autouse=True)
def no_patch_outlives_the_test():
    yield
    # Instance patches die with their models; revert them anyway so the shared rotary function is released.
    for handle in list(patching._instance_handles.values()):
        handle.revert()
    forgotten = [
        model_type for model_type, handles in patching._type_handles.items() if any(h.active for h in handles)
    ]
    for handles in patching._type_handles.values():
        for handle in handles:
            handle.revert()
    patching._type_handles.clear()
    leaked = sorted(
        f"{getattr(entry[0], '__name__', entry[0])}.{key[1]}"
        for key, entry in patching._shared._entries.items()
    )
    patching._shared._entries.clear()
    assert not forgotten, f"class patches left applied after the test: {forgotten}"
    assert not leaked, f"shared attributes still patched after every handle was reverted: {leaked}"


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the calls of each public kernel function the patched models use (they look the kernels up per
    call, so the counters see every call)."""
    calls: Counter = Counter()
    for module_name, function_name in [
        ("rms_norm", "rms_norm"),
        ("rms_norm", "add_rms_norm"),
        ("rope", "apply_rotary_pos_emb"),
        ("swiglu", "swiglu"),
        ("swiglu", "geglu"),
        ("swiglu", "gated_mlp"),
        ("swiglu", "add_rms_norm_gated_mlp"),
        ("fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    ]:
        module = importlib.import_module(f"fusetune.kernels.{module_name}")
        real = getattr(module, function_name)

        def counted(*args, _real=real, _name=function_name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, function_name, counted)
    return calls

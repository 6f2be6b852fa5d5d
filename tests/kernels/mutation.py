"""Mutation tests' one tool: a copy of a Triton kernel with one source edit, to show that a test fails a
wrong kernel."""

from __future__ import annotations

import inspect
import re
import uuid


def mutated_kernel(kernel, old: str, new: str, tmp_path, name: str | None = None, *, count: int = 1):
    """A copy of the Triton kernel ``kernel`` with ``old`` replaced by ``new`` (``count`` times) in its
    source or, where the kernel's own source lacks ``old``, in the one @triton.jit helper it calls that has
    it (the norms' backward kernels share their tile tail, for example).

    The copy lives in a file of its own (Triton reads kernel sources from files) and runs with the
    original modules' globals, so it calls the same other helpers; a mutated helper is written into the
    same file, ahead of the kernel, which then calls it.
    """
    source = inspect.getsource(kernel.fn)
    namespace = dict(kernel.fn.__globals__)
    if old in source:
        assert source.count(old) == count, f"mutation anchor found {source.count(old)} times: {old!r}"
        text = source.replace(old, new)
    else:
        helpers = [
            helper
            for helper_name, helper in namespace.items()
            if _is_jit_function(helper)
            and re.search(rf"\b{re.escape(helper_name)}\(", source)
            and old in inspect.getsource(helper.fn)
        ]
        assert len(helpers) == 1, f"mutation anchor not in the kernel, and in {len(helpers)} helpers: {old!r}"
        helper_source = inspect.getsource(helpers[0].fn)
        assert helper_source.count(old) == count, f"anchor found {helper_source.count(old)} times: {old!r}"
        namespace = {**helpers[0].fn.__globals__, **namespace}
        text = helper_source.replace(old, new) + "\n\n" + source
    path = tmp_path / f"{name or kernel.fn.__name__}_{uuid.uuid4().hex[:8]}.py"
    path.write_text(text)
    exec(compile(text, str(path), "exec"), namespace)
    return namespace[kernel.fn.__name__]


def _is_jit_function(value) -> bool:
    """A @triton.jit function: a JITFunction on the GPU, an InterpretedFunction under TRITON_INTERPRET=1."""
    return inspect.isfunction(getattr(value, "fn", None)) and hasattr(value, "arg_names")

"""Mutation tests' tools: a copy of a Triton kernel, or of a plain Python function, with one source edit, to show
that a test fails a wrong kernel or function."""

from __future__ import annotations
import __future__

import inspect
import re
import textwrap
import uuid


def mutated_kernel(kernel, old: str, new: str, tmp_path, name: str | None = None, *, count: int = 1):
    """A copy of the Triton kernel ``kernel`` with ``old`` replaced by ``new`` (``count`` times) in its
    source or, where the kernel's own source lacks ``old``, in the one @triton.jit helper that has it among
    those the kernel calls, directly or through other helpers (the norms' backward kernels share their tile
    tail; the optimizers' kernels call their block update, which calls the rounding helpers).

    The copy lives in a file of its own (Triton reads kernel sources from files), with copies of every helper
    on the way, and runs with the original modules' globals, so a helper off the way is the original one.
    """
    source = inspect.getsource(kernel.fn)
    namespace = dict(kernel.fn.__globals__)
    if old in source:
        assert source.count(old) == count, f"mutation anchor found {source.count(old)} times: {old!r}"
        text = source.replace(old, new)
    else:
        paths = [path for path in _helper_paths(kernel) if old in inspect.getsource(path[-1].fn)]
        assert len(paths) == 1, f"mutation anchor not in the kernel, and in {len(paths)} helpers: {old!r}"
        helper_source = inspect.getsource(paths[0][-1].fn)
        assert helper_source.count(old) == count, f"anchor found {helper_source.count(old)} times: {old!r}"
        for helper in paths[0]:
            namespace = {**helper.fn.__globals__, **namespace}
        on_the_way = [inspect.getsource(helper.fn) for helper in reversed(paths[0][:-1])]
        text = "\n\n".join([helper_source.replace(old, new), *on_the_way, source])
    path = tmp_path / f"{name or kernel.fn.__name__}_{uuid.uuid4().hex[:8]}.py"
    path.write_text(text)
    exec(compile(text, str(path), "exec"), namespace)
    return namespace[kernel.fn.__name__]


def _helper_paths(function, seen: frozenset = frozenset()) -> list[list]:
    """Each @triton.jit helper that `function` calls, directly or through others, as the list of helpers from
    the one `function` calls to it."""
    source = inspect.getsource(function.fn)
    seen = seen | {function.fn.__name__}  # its own `def name(` is no call
    paths = []
    for helper_name, helper in function.fn.__globals__.items():
        calls = re.search(rf"\b{re.escape(helper_name)}\(", source)
        if _is_jit_function(helper) and helper_name not in seen and calls:
            paths.append([helper])
            paths += [[helper, *path] for path in _helper_paths(helper, seen)]
    return paths


def _is_jit_function(value) -> bool:
    """A @triton.jit function: a JITFunction on the GPU, an InterpretedFunction under TRITON_INTERPRET=1."""
    return inspect.isfunction(getattr(value, "fn", None)) and hasattr(value, "arg_names")


def mutated_function(function, old: str, new: str, *, count: int = 1):
    """A copy of the module-level Python function ``function`` with ``old`` replaced by ``new`` (``count``
    times), run with its module's globals: monkeypatched over the original, it is what the module's callers
    call."""
    source = textwrap.dedent(inspect.getsource(function))
    assert source.count(old) == count, f"mutation anchor found {source.count(old)} times: {old!r}"
    namespace = dict(function.__globals__)
    # Annotations stay strings, as in the module (which has `from __future__ import annotations`).
    flags = __future__.annotations.compiler_flag
    exec(
        compile(source.replace(old, new), f"<mutant of {function.__name__}>", "exec", flags=flags), namespace
    )
    return namespace[function.__name__]

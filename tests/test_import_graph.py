"""The package's imports point one way: no circle among its modules, and the layers of STYLE.md hold.

Imports are read with `ast`, those inside function bodies included (an import moved into a function to dodge a
circle is still a circle); only imports under `if TYPE_CHECKING:` are left out, since they never run.
"""

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "fusetune"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    names: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if _is_type_checking_block(child):
                pending.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[
                        : len(module.split(".")) - child.level + (1 if is_package else 0)
                    ]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module or ""
                names.add(source)
                # `from package import submodule` imports the submodule.
                names.update(f"{source}.{alias.name}" for alias in child.names)
            pending.append(child)
    return names


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = _imported_names(tree, module, path.name == "__init__.py")
        graph[module] = {name for name in imported if name in paths and name != module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_the_package_imports_itself_round_a_circle():
    assert circles(import_graph()) == []


# Which parts of the package each layer may import (STYLE.md: api -> spec <- worker, api -> tokenization <- worker,
# api -> db <- worker -> models -> kernels; kernels import nothing of fusetune).
FORBIDDEN = {
    "fusetune.spec": ("fusetune.",),
    # Below the API and the worker alike, beside spec, which it uses.
    "fusetune.tokenization": (
        "fusetune.api",
        "fusetune.worker",
        "fusetune.db",
        "fusetune.models",
        "fusetune.kernels",
    ),
    "fusetune.kernels": ("fusetune.",),
    # The command line's HTTP client reaches a server through its API alone.
    "fusetune.client": ("fusetune.",),
    "fusetune.api": ("fusetune.worker", "fusetune.serving", "fusetune.models", "fusetune.kernels"),
    "fusetune.db": ("fusetune.api", "fusetune.worker", "fusetune.models", "fusetune.kernels"),
    "fusetune.models": ("fusetune.api", "fusetune.worker", "fusetune.db"),
    "fusetune.worker.train": ("fusetune.api", "fusetune.worker."),
    # Graders are called by the API and the trainer alike; they read the spec and the settings only.
    "fusetune.graders": (
        "fusetune.api",
        "fusetune.worker",
        "fusetune.db",
        "fusetune.models",
        "fusetune.kernels",
    ),
}


def test_each_layer_imports_only_what_is_below_it():
    wrong = []
    for module, imported in import_graph().items():
        for layer, forbidden in FORBIDDEN.items():
            if module == layer or module.startswith(layer + "."):
                wrong += [
                    f"{module} -> {name}"
                    for name in imported
                    if name.startswith(forbidden) and not name.startswith(layer)
                ]
    assert wrong == []

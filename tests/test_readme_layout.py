"""The README's layout section names what the tree holds: every path it names exists, every part of the package
and every module of the trainer is named."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _layout_blocks() -> tuple[str, str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Layout\n") :]
    blocks = re.findall(r"```\n(.*?)```", section, re.DOTALL)
    return blocks[0], blocks[1]  # the package, then the trainer


def _named(block: str) -> set[str]:
    """Modules named anywhere in a block, folders only where a line starts with one (prose has slashes too)."""
    return set(re.findall(r"[\w./-]+\.py", block)) | set(re.findall(r"^([\w./-]+/)", block, re.MULTILINE))


def test_every_path_the_layout_names_exists():
    package, trainer = _layout_blocks()
    for name in _named(package):
        if name.startswith(("fusetune/", "migrations/", "benchmarks/", "tests/")):
            assert (ROOT / name).exists(), name
    train = ROOT / "fusetune/worker/train"
    for name in _named(trainer):  # a module of train/ or of one of its packages (methods/base.py)
        if name.startswith("fusetune/"):
            assert (ROOT / name).exists(), name
            continue
        assert (train / name).exists() or any(train.glob(f"*/{name}")), name


def test_every_part_of_the_package_and_of_the_trainer_is_named():
    package, trainer = _layout_blocks()
    for entry in sorted((ROOT / "fusetune").iterdir()):
        if entry.name.startswith(("_", ".")) or entry.suffix not in ("", ".py") or entry.name == "py.typed":
            continue
        name = f"fusetune/{entry.name}/" if entry.is_dir() else entry.name
        assert name in package, f"README's layout does not name {name}"
    for entry in sorted((ROOT / "fusetune/worker/train").iterdir()):
        if entry.name.startswith(("_", ".")):
            continue
        name = f"{entry.name}/" if entry.is_dir() else entry.name
        assert re.search(rf"(^|\s){re.escape(name)}", trainer, re.MULTILINE), (
            f"the trainer's layout lacks {name}"
        )

"""requirements.lock is what `make install` installs: it must pin, with hashes, a version inside pyproject.toml's
range for every dependency (base, dev and tracking extras), and requirements-service.lock (the image's) must
pin the same versions. A dependency added to pyproject.toml without `make lock` fails here, before an install
from the lock leaves it out."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pins(path: Path) -> dict[str, str]:
    """name -> version of the pins that apply to this interpreter and platform."""
    text = path.read_text(encoding="utf-8")
    found: dict[str, str] = {}
    for line in re.findall(r"^([A-Za-z0-9][^\s\\]*==[^\s\\;]+(?:\s*;[^\\\n]+)?)", text, re.MULTILINE):
        requirement, _, marker = line.partition(";")
        if marker.strip() and not Marker(marker.strip()).evaluate():
            continue
        name, _, version = requirement.strip().partition("==")
        found[canonicalize_name(name)] = version
    return found


def hashed_entries(path: Path) -> tuple[int, int]:
    text = path.read_text(encoding="utf-8")
    entries = re.findall(
        r"^[A-Za-z0-9][^\n]*==[^\n]*\\\n((?:\s+--hash=sha256:[0-9a-f]{64}[ \\]*\n)+)", text, re.M
    )
    return len(re.findall(r"^[A-Za-z0-9][^\s]*==", text, re.M)), len(entries)


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    names += project["optional-dependencies"]["tracking"]
    return [Requirement(name) for name in names]


@pytest.mark.parametrize("lock", ["requirements.lock", "requirements-service.lock"])
def test_every_pin_carries_its_hashes(lock):
    pinned, hashed = hashed_entries(ROOT / lock)
    assert pinned > 50 and hashed == pinned


def test_the_lock_pins_every_dependency_inside_its_range():
    locked = pins(ROOT / "requirements.lock")
    for requirement in declared():
        if requirement.marker and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in locked, (
            f"{requirement.name} is in pyproject.toml but not in requirements.lock: make lock"
        )
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"requirements.lock pins {requirement.name}=={locked[name]}, outside {requirement}: make lock"
        )


def test_the_image_lock_pins_the_same_versions():
    locked, service = pins(ROOT / "requirements.lock"), pins(ROOT / "requirements-service.lock")
    assert {"torch", "fastapi", "celery"} <= service.keys()
    assert {name: version for name, version in service.items() if locked.get(name) != version} == {}


def test_the_readme_names_the_locked_versions():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Installs: the lock file") :]
    section = section[: section.index("\n## ")]
    locked = pins(ROOT / "requirements.lock")
    for name in ("torch", "transformers", "triton"):
        assert f"{name} {locked[name]}" in section, (
            f"README's lock section does not name {name} {locked[name]}"
        )

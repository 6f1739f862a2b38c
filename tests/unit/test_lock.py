"""The lock (constraints.txt, docs/dependencies.md "The lock"): every dependency pyproject.toml names
is pinned, within its bounds, and every install path (the Makefile, the service image) uses it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
#: Installed as the Makefile's TORCH says (a CPU build here, a CUDA one on a GPU machine), never locked.
UNLOCKED = {"torch"}


def lock() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line.strip())
        assert m, f"constraints.txt: not a pin of one exact version: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt pins {name} twice"
        pins[name] = Version(m.group(2))
    return pins


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return [Requirement(r) for r in reqs]


def test_the_lock_pins_every_dependency_within_its_bounds() -> None:
    pins = lock()
    assert not UNLOCKED & pins.keys(), "torch is installed as TORCH says, not from the lock"
    for req in requirements():
        name = canonicalize_name(req.name)
        if name in UNLOCKED:
            continue
        assert name in pins, f"{req.name} (pyproject.toml) is not in constraints.txt: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}: run `make upgrade`"
        )
        for extra in req.extras:  # redis[hiredis]: the package the extra brings is pinned as well
            assert canonicalize_name(extra) in pins, f"{extra} ({req}) is not in constraints.txt"


def test_every_install_uses_the_lock() -> None:
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^LOCK\s+\?= constraints\.txt$", make, re.M), "make install's default lock"
    assert re.search(r"^\$\(STAMP\): pyproject\.toml \$\(LOCK\)$", make, re.M), "a new lock reinstalls"
    installs = [line for line in make.splitlines() if re.search(r"(pip install|\$\(UV_PIP\)) ", line)]
    venv = [line for line in installs if "$(PY) -m pip" in line or line.strip().startswith("$(UV_PIP)")]
    unlocked = [line for line in venv if "WITH_LOCK" not in line and "--no-deps" not in line]
    assert not unlocked, f"installs into .venv without the lock: {unlocked}"
    image = (ROOT / "docker" / "Dockerfile").read_text()
    assert "pip install --constraint constraints.txt ." in image
    assert "constraints.txt" in re.search(r"^COPY pyproject\.toml.*$", image, re.M).group(0)  # type: ignore[union-attr]

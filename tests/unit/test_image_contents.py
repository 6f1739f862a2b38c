"""The image holds every package the project installs: `docker/Dockerfile` copies each package that
pyproject.toml's package discovery includes, before `pip install .` (an image without `sim/` failed
every `bubbletea health` healthcheck: the CLI imports it to build its parser)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dockerfile_copies_every_installed_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \./\1\s*$", dockerfile, flags=re.M))
    assert packages <= copied, f"docker/Dockerfile does not copy {sorted(packages - copied)}"
    install = re.search(r"pip install (--constraint \S+ )?\. ", dockerfile).start()  # type: ignore[union-attr]
    for name in packages:
        assert dockerfile.index(f"COPY {name} ") < install, f"{name} is copied after the project is installed"

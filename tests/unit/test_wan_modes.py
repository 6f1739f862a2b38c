"""Which WAN mode a launcher whose default is kernel-where-it-can-run (`bubbletea demo`) picks:
`--wan` first, then a `wan.mode` the spec file names; else the machine decides (kernel_wan's
`default_wan_mode`, tested on the real kernel in tests/integration/test_kernel_wan.py)."""

from pathlib import Path

import yaml

from bubbletea.launcher.wan_modes import launcher_wan_mode, spec_names_wan_mode
from shared.config.settings import load_settings

DEMO = Path(__file__).parents[2] / "configs" / "demo.yaml"


def _spec(tmp_path: Path, mode: str | None) -> Path:
    raw = yaml.safe_load(DEMO.read_text())
    if mode is not None:
        raw["wan"]["mode"] = mode
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_shipped_demo_spec_leaves_the_mode_to_the_launcher(tmp_path: Path) -> None:
    assert not spec_names_wan_mode(DEMO)
    assert spec_names_wan_mode(_spec(tmp_path, "model"))


def test_wan_on_the_command_line_wins(tmp_path: Path) -> None:
    env = {"BUBBLETEA_WAN": "model"}  # what --wan model sets
    settings = load_settings(_spec(tmp_path, "kernel"), env=env)
    assert launcher_wan_mode(settings, env) == ("model", "--wan", False)


def test_a_spec_naming_its_mode_keeps_it(tmp_path: Path) -> None:
    path = _spec(tmp_path, "model")
    assert launcher_wan_mode(load_settings(path, env={}), {}) == ("model", f"wan.mode in {path}", False)


def test_a_redis_the_user_named_is_not_rebound_without_asking(tmp_path: Path) -> None:
    env = {"REDIS_URL": "redis://127.0.0.1:6379/0"}
    mode, why, defaulted = launcher_wan_mode(load_settings(_spec(tmp_path, None), env=env), env)
    assert (mode, defaulted) == ("model", True) and "REDIS_URL is set" in why and "--wan kernel" in why

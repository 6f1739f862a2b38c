"""The environment variables' one table (`shared.config.env.ENV`): docs/config.md's table, the
module's docstring and `ENV_VARS` are made from it, and a variable is read as its row says."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import env
from shared.config.settings import load_settings
from shared.config.spec import ConfigError

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python -c 'from shared.config.env import markdown_table; print(markdown_table(), end=\"\")'"


def test_the_docs_table_is_the_one_made_from_the_table() -> None:
    doc = (ROOT / "docs" / "config.md").read_text()
    start = doc.index("| variable | effect |\n")
    lines = doc[start:].splitlines(keepends=True)
    table = "".join(lines[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))])
    assert table == env.markdown_table(), f"docs/config.md's table differs from ENV: paste {REGENERATE}"


def test_the_docstring_and_env_vars_list_every_row() -> None:
    names = [v.name for v in env.ENV]
    assert len(names) == len(set(names))
    assert all(f"``{name}``" in (env.__doc__ or "") for name in names)
    assert {v.name for v in env.ENV if not v.command} == env.ENV_VARS
    assert {v.name for v in env.ENV if v.command} <= env.OTHER_ENV_VARS


def test_a_variable_with_a_default_reads_it_unset_and_an_empty_one_as_given() -> None:
    level = next(v for v in env.ENV if v.name == "BUBBLETEA_LOG_LEVEL")
    host = next(v for v in env.ENV if v.name == "BUBBLETEA_HTTP_HOST")
    assert level.value({}) == "INFO" and level.value({"BUBBLETEA_LOG_LEVEL": ""}) == ""
    assert host.value({}) is None and host.value({"BUBBLETEA_HTTP_HOST": ""}) is None


def test_each_row_changes_what_it_says() -> None:
    s = load_settings(
        env={
            "BUBBLETEA_HTTP_PORT": "8123",
            "BUBBLETEA_LOG_LEVEL": "debug",
            "BUBBLETEA_TTFT_OBJECTIVE_MS": "  ",  # blank: no change
            "BUBBLETEA_ITERATIONS": "until_stopped",
            "BUBBLETEA_METRICS_PORT": "off",
            "BUBBLETEA_TIME_SCALE": "2",
        }
    )
    assert s.spec.http.port == 8123 and s.log_level == "DEBUG" and s.metrics_port is None
    assert s.spec.training.until_stopped and s.time_scale == 2.0
    assert s.base_spec is not None and s.spec.prefill.request_timeout_s == 2 * s.base_spec.prefill.request_timeout_s
    with pytest.raises(ConfigError, match="BUBBLETEA_METRICS_AUTH=on puts /metrics behind the API key"):
        load_settings(env={"BUBBLETEA_METRICS_AUTH": "on"})

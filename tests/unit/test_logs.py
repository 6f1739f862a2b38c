import json
import logging

import pytest

from shared.config.settings import load_settings
from shared.config.spec import ConfigError
from shared.runtime.logs import JsonFormatter, KeyValueFormatter


def render(msg: str, **fields: object) -> str:
    rec = logging.LogRecord("t", logging.INFO, __file__, 1, msg, None, None)
    rec.fields = fields
    return KeyValueFormatter().format(rec)


def test_key_value_line_with_quoting() -> None:
    line = render("handled", id="1-0", kind="ping", ms=0.12345, note='a "b" c')
    assert " msg=handled " in line
    assert " id=1-0 kind=ping ms=0.123 " in line
    assert line.endswith('note="a \\"b\\" c"')
    assert "\n" not in render("two\nlines")


def test_json_lines_carry_the_same_fields_typed() -> None:
    rec = logging.LogRecord("t", logging.WARNING, __file__, 1, "handled", None, None)
    rec.fields = {"id": "1-0", "attempt": 2, "ms": 0.5, "msg": "not the envelope"}
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    got = json.loads(line)
    assert got["level"] == "warning" and got["msg"] == "handled" and got["logger"] == "t"
    assert (got["id"], got["attempt"], got["ms"]) == ("1-0", 2, 0.5)


def test_the_log_format_is_read_once_and_validated() -> None:
    assert load_settings(env={"BUBBLETEA_LOG_FORMAT": "JSON"}).log_format == "json"
    assert load_settings(env={}).log_format == "kv"
    with pytest.raises(ConfigError, match="BUBBLETEA_LOG_FORMAT: expected one of kv, json"):
        load_settings(env={"BUBBLETEA_LOG_FORMAT": "xml"})


@pytest.fixture
def warnings_as_records():
    """Warnings shown (not raised, as the suite has them) and routed to logging, restored after."""
    import warnings

    logger = logging.getLogger("py.warnings")
    level = logger.level
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # from the state this test's own catch_warnings holds: an earlier test in this process may
        # have left logging capturing warnings (setup_logging), which a second call would not redo
        logging.captureWarnings(False)
        try:
            yield
        finally:
            logging.captureWarnings(False)
            logger.setLevel(level)


def test_a_warning_is_a_log_record_of_the_process_format(
    warnings_as_records: None, caplog: pytest.LogCaptureFixture
) -> None:
    import warnings

    logging.captureWarnings(True)  # what setup_logging does, without replacing pytest's handlers
    with caplog.at_level(logging.WARNING, logger="py.warnings"):
        warnings.warn("a dependency's deprecation", UserWarning, stacklevel=1)
    [rec] = [r for r in caplog.records if r.name == "py.warnings"]
    got = json.loads(JsonFormatter().format(rec))  # one JSON line, as every other record
    assert got["level"] == "warning" and "a dependency's deprecation" in got["msg"]


@pytest.mark.parametrize("verbose", [False, True])
def test_the_command_shows_a_dependencys_warning_only_with_v(
    warnings_as_records: None, caplog: pytest.LogCaptureFixture, verbose: bool
) -> None:
    """A warning never stands in place of the command's one line (Ctrl-C, an error); -v shows it."""
    import warnings

    from bubbletea.cli import _quiet_warnings

    _quiet_warnings(verbose)
    warnings.warn("a dependency's deprecation", UserWarning, stacklevel=1)
    shown = [r for r in caplog.records if r.name == "py.warnings"]
    assert bool(shown) is verbose, shown

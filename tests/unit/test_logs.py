import logging

from shared.logs import KeyValueFormatter


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

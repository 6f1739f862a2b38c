from shared.bus.streams import format_id, parse_id


def test_ids_parse_and_order_numerically() -> None:
    assert parse_id(b"1700000000000-3") == (1700000000000, 3)
    assert parse_id("5") == (5, 0)
    assert parse_id("10-0") > parse_id("9-99")  # numeric, not lexical
    assert format_id(*parse_id("12-7")) == "12-7"

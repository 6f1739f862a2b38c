"""A worker's KV shelf (`prefill.kv_store: plane`): caches held until freed or `kv_ttl_s` after
their answer, never more bytes at once than the budget (past it the answer says why), a cache
answered twice held once."""

from shared.dataplane.kv import KvShelf


def test_caches_are_held_until_freed_or_expired() -> None:
    shelf = KvShelf(ttl_s=30, budget_bytes=1000)
    assert shelf.put("a", b"x" * 100, now=0.0).key == "a"
    assert shelf.get("a", now=29.9) == b"x" * 100
    assert shelf.get("a", now=30.0) is None  # expired: gone for a fetch even before the sweep
    assert shelf.expire(now=30.0) == 1 and shelf.used == 0
    shelf.put("b", b"y" * 10, now=0.0)
    assert shelf.delete("b") and not shelf.delete("b") and shelf.used == 0


def test_the_budget_bounds_the_bytes_held_at_once() -> None:
    shelf = KvShelf(ttl_s=30, budget_bytes=250)
    assert shelf.put("a", b"x" * 100, now=0.0).key == "a"
    assert shelf.put("b", b"x" * 100, now=1.0).key == "b"
    refused = shelf.put("c", b"x" * 100, now=2.0)
    assert refused.key == "" and (refused.used, refused.size, refused.budget) == (200, 100, 250)
    shelf.delete("a")  # freed by a decoder: its room is back at once
    assert shelf.put("c", b"x" * 100, now=3.0).key == "c"
    assert shelf.put("d", b"x" * 100, now=30.5).key == ""  # "b" (until 31 s) and "c" still held
    assert shelf.put("d", b"x" * 100, now=31.0).key == "d"  # "b" expired: its room is back
    assert shelf.used == 200 and set(shelf.held) == {"c", "d"}


def test_a_cache_answered_twice_is_held_once() -> None:
    shelf = KvShelf(ttl_s=30, budget_bytes=150)
    shelf.put("a", b"x" * 100, now=0.0)
    assert shelf.put("a", b"z" * 100, now=1.0).key == "a" and shelf.used == 100
    assert shelf.get("a", now=1.0) == b"z" * 100

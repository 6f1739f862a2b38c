"""The vLLM connector's pure parts (bubbletea_vllm: handle, layout, holders), without vLLM.

The connector itself runs inside vLLM and is tested there (tests/vllm, `make test-vllm`)."""

from __future__ import annotations

import threading

import pytest
import torch
from bubbletea_vllm.handle import BadCache, Handle, check, layer_index, metadata, parse_handle
from bubbletea_vllm.holders import HolderQueues
from bubbletea_vllm.layout import CacheFile, blocks_written, slot_mapping

from shared.dataplane.kvstore import kv_file

HANDLE = {
    "remote_engine_id": "bubbletea",
    "store": "plane",
    "key": "cmpl-1",
    "holder": "10.0.0.2:41234",
    "prompt_tokens": 5,
    "expires_at": 1e9,
}


def test_a_handle_is_read_from_the_front_doors_kv_transfer_params() -> None:
    h = parse_handle(HANDLE)
    assert h == Handle(key="cmpl-1", holder="10.0.0.2:41234", prompt_tokens=5, expires_at=1e9)
    # vLLM computes at least the last token it is given: the prompt followed by our first token
    # loads all 5 positions, the prompt alone loads 4
    assert h.loadable(6) == 5 and h.loadable(5) == 4 and h.loadable(1) == 0


def test_other_params_are_not_ours_and_a_handle_without_a_cache_says_why() -> None:
    assert parse_handle(None) is None
    assert parse_handle({"remote_engine_id": "nixl", "store": "plane"}) is None
    with pytest.raises(BadCache, match="the KV byte budget was full"):
        parse_handle({**HANDLE, "store": "none", "why": "the KV byte budget was full"})
    with pytest.raises(BadCache, match="reads only 'plane'"):
        parse_handle({**HANDLE, "store": "redis"})
    with pytest.raises(BadCache, match="malformed"):
        parse_handle({k: v for k, v in HANDLE.items() if k != "holder"})


def _cache(prompt: list[int], layers: int = 2, heads: int = 2, dim: int = 4) -> tuple[bytes, list]:
    g = torch.Generator().manual_seed(0)
    kv = [
        (torch.randn(1, heads, len(prompt), dim, generator=g), torch.randn(1, heads, len(prompt), dim, generator=g))
        for _ in range(layers)
    ]
    return kv_file("cmpl-1", "m", prompt, 7, kv), kv


def test_a_cache_is_checked_against_the_requests_prompt() -> None:
    data, _ = _cache([3, 1, 4, 1, 5])
    h = parse_handle(HANDLE)
    assert h is not None
    meta = metadata(data)
    check(meta, h, [3, 1, 4, 1, 5, 9], 5)  # the prompt and our first token: fine
    with pytest.raises(BadCache, match="another prompt"):
        check(meta, h, [3, 1, 4, 1, 6, 9], 5)
    with pytest.raises(BadCache, match="format"):
        check({**meta, "format": "other/2"}, h, [3, 1, 4, 1, 5], 5)
    with pytest.raises(BadCache, match="not a safetensors file"):
        metadata(b"tiny")


def test_rows_are_the_caches_positions_as_vllm_writes_them() -> None:
    data, kv = _cache([3, 1, 4, 1, 5])
    f = CacheFile(data)
    k, v = f.rows(1, 2, 5, torch.float32)
    assert k.shape == (3, 2, 4)  # (positions, kv_heads, head_dim): a forward pass's key rows
    assert torch.equal(k, kv[1][0][0, :, 2:5].transpose(0, 1))
    assert torch.equal(v, kv[1][1][0, :, 2:5].transpose(0, 1))
    assert f.rows(0, 0, 5, torch.bfloat16)[0].dtype == torch.bfloat16
    f.check_shape(0, 2, 4)
    with pytest.raises(BadCache, match="same checkpoint"):
        f.check_shape(0, 8, 4)
    with pytest.raises(BadCache, match="no layer 2"):
        f.rows(2, 0, 5, torch.float32)


def test_slots_follow_the_requests_blocks() -> None:
    # blocks 5 then 2, of 4 slots each: positions 0-3 in block 5 (slots 20-23), 4-7 in block 2
    assert slot_mapping([5, 2], 4, 0, 7).tolist() == [20, 21, 22, 23, 8, 9, 10]
    assert slot_mapping([5, 2], 4, 3, 5).tolist() == [23, 8]  # a head already in vLLM's own cache
    with pytest.raises(BadCache, match="do not fit"):
        slot_mapping([5], 4, 0, 5)


def test_layer_names_give_the_decoder_layer() -> None:
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("language_model.model.layers.12.self_attn.attn") == 12
    with pytest.raises(BadCache):
        layer_index("lm_head")


def test_a_failed_load_names_the_blocks_it_was_to_write() -> None:
    # positions 32..69 of a request with blocks [4, 9, 2] of 32: blocks 9 and 2, not block 4, which
    # holds vLLM's own (prefix-cached, maybe shared) positions 0..31
    assert blocks_written([4, 9, 2], 32, 32, 70) == {9, 2}
    assert blocks_written([4, 9, 2], 32, 0, 64) == {4, 9}
    assert blocks_written([4, 9, 2], 32, 5, 5) == set()


def test_jobs_take_turns_per_holder_and_one_stuck_holder_holds_up_only_its_own() -> None:
    q = HolderQueues("test")
    release, done = threading.Event(), []
    q.submit("stuck:1", lambda: (release.wait(10), done.append("stuck-1")))
    q.submit("stuck:1", lambda: done.append("stuck-2"))  # behind the stuck one
    q.submit("fine:2", lambda: done.append("fine"))
    assert not q.wait_idle(timeout_s=0.5)
    assert done == ["fine"] and q.pending() == 2
    release.set()
    assert q.wait_idle(timeout_s=10)
    assert done == ["fine", "stuck-1", "stuck-2"]
    assert not [t for t in threading.enumerate() if t.name.startswith("test-")]  # none lingers once idle


def test_a_job_that_raises_does_not_stop_its_holders_queue() -> None:
    q = HolderQueues("test")
    done: list[str] = []

    def boom() -> None:
        raise RuntimeError("a bug")

    q.submit("h:1", boom)
    q.submit("h:1", lambda: done.append("next"))
    assert q.wait_idle(timeout_s=10) and done == ["next"]

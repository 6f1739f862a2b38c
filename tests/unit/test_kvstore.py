"""The KV cache leaves the system as safetensors with a documented layout (docs/api.md)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from shared.dataplane.kvstore import KV_FORMAT, KV_METADATA, kv_file, read_kv_file, safetensors_metadata
from shared.model.prefill import PrefillModel
from shared.model.shape import GPTConfig
from shared.wire import WireError


def test_a_kv_cache_is_safetensors_any_reader_reads_with_the_documented_layout(tmp_path: object) -> None:
    model = PrefillModel(GPTConfig(layers=3, d_model=32, heads=4, seq_len=64, vocab=256), seed=2)
    prompt = list(b"hello world")
    res = model.prefill(prompt)
    data = kv_file("req-1", "tiny", prompt, res.token, res.kv)

    # the plain safetensors library, knowing nothing of BubbleTea
    tensors = load(data)
    assert sorted(tensors) == sorted(f"layers.{i}.{kind}" for i in range(3) for kind in "kv")
    for i, (k, v) in enumerate(res.kv):
        assert tensors[f"layers.{i}.k"].shape == (4, len(prompt), 8) and tensors[f"layers.{i}.k"].dtype == torch.float32
        assert torch.equal(tensors[f"layers.{i}.k"], k[0]) and torch.equal(tensors[f"layers.{i}.v"], v[0])
    path = tmp_path / "kv.safetensors"  # type: ignore[operator]
    path.write_bytes(data)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert set(meta) == set(KV_METADATA) and meta["format"] == KV_FORMAT
    assert json.loads(meta["prompt"]) == prompt and int(meta["first_token"]) == res.token
    assert (meta["layers"], meta["prompt_tokens"], meta["dtype"]) == ("3", str(len(prompt)), "float32")
    assert safetensors_metadata(data) == meta  # our header reader agrees with the library's

    # and back, as the model uses it
    stored = read_kv_file(data)
    assert stored.prompt == prompt and stored.first_token == res.token
    assert all(
        torch.equal(a, b) for (ka, va), (kb, vb) in zip(stored.kv, res.kv, strict=True) for a, b in ((ka, kb), (va, vb))
    )


def test_other_bytes_are_refused_with_a_reason() -> None:
    with pytest.raises(WireError, match="shorter than its header"):
        read_kv_file(b"abc")
    from safetensors.torch import save

    with pytest.raises(WireError, match="not a bubbletea-kv/1 KV cache"):
        read_kv_file(save({"x": torch.zeros(2)}, metadata={"format": "other"}))

"""A layer run in pieces of tokens (`PrefillModel.run_piece`): the same answer as whole layers (up
to float rounding: other matrix shapes), resumable between pieces, and the policy that says when
(`shared.policies.fill.piece_tokens`: pieces on a GPU, whole layers on a CPU unless asked)."""

from __future__ import annotations

import pytest
import torch

from shared.dataplane import kvstore
from shared.model.gpt import GPTConfig
from shared.model.graphs import bucket
from shared.model.prefill import PrefillModel
from shared.policies.fill import GPU_PIECE_TOKENS, piece_tokens

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false (a CPU-only torch build, or no visible GPU)"

CFG = GPTConfig(layers=3, d_model=32, heads=4, seq_len=128, vocab=256)
PROMPT = [(7 * i) % 256 for i in range(100)]


@pytest.mark.parametrize("piece", [1, 7, 32, 99, 100, 1000])
def test_a_prompt_run_in_pieces_gives_the_whole_layers_answer(piece: int) -> None:
    torch.manual_seed(0)
    model = PrefillModel(CFG, seed=3)
    want = model.prefill(PROMPT, top_logprobs=3)
    state = model.start(PROMPT)
    pieces = 0
    while not state.done:
        ran = model.run_piece(state, piece)
        assert 0 < ran <= piece and (state.piece_done == 0 or state.piece_done % piece == 0)
        pieces += 1
    assert pieces == CFG.layers * -(-len(PROMPT) // piece)
    got = model.finish(state, top_logprobs=3)
    assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert [t for t, _ in got.top] == [t for t, _ in want.top]
    for (k, v), (wk, wv) in zip(got.kv, want.kv, strict=True):
        assert torch.allclose(k, wk, atol=1e-5) and torch.allclose(v, wv, atol=1e-5)
    if piece >= len(PROMPT):  # one piece is the whole layer: exactly the unpieced block
        assert all(torch.equal(k, wk) for (k, _), (wk, _) in zip(got.kv, want.kv, strict=True))


def test_a_state_cut_between_pieces_resumes_and_snapshots_at_its_last_whole_layer() -> None:
    model = PrefillModel(CFG, seed=3)
    want = model.prefill(PROMPT)
    state = model.start(PROMPT)
    for _ in range(5):  # layer 0 whole (4 pieces of 32), then one piece of layer 1
        model.run_piece(state, 32)
    assert (state.next_layer, state.piece_done) == (1, 32)
    # handed back now, its snapshot is the last whole layer: a resume redoes layer 1 from its start
    restored = kvstore.restore(kvstore.snapshot("p", state), model.layers)
    assert restored.next_layer == 1 and restored.piece_done == 0
    assert model.finish(model.run_layers(restored)).token == want.token
    # kept in memory (the next bubble), it goes on from the piece it reached
    while not state.done:
        model.run_piece(state, 32)
    assert model.finish(state).token == want.token


def test_pieces_on_a_gpu_whole_layers_on_a_cpu_unless_the_spec_says() -> None:
    assert piece_tokens(0, on_gpu=False) is None  # on the CPU, as it always was
    assert piece_tokens(0, on_gpu=True) == GPU_PIECE_TOKENS
    assert piece_tokens(64, on_gpu=False) == 64 and piece_tokens(64, on_gpu=True) == 64
    with pytest.raises(ValueError, match="at least 1 token"):
        PrefillModel(CFG, seed=3).run_piece(PrefillModel(CFG, seed=3).start([1]), 0)


def test_graph_buckets_and_graphs_need_a_gpu() -> None:
    assert [bucket(n) for n in (1, 16, 17, 200, 256, 257)] == [16, 16, 32, 256, 256, None]
    model = PrefillModel(GPTConfig(layers=2, d_model=16, heads=2, seq_len=32, vocab=64), seed=1)
    with pytest.raises(ValueError, match="CUDA graphs need a GPU"):
        model.use_graphs()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("tokens", [9, 64, 200, 700])  # padded within a bucket, exact, one piece of many
def test_a_graphed_prefill_equals_the_eager_one(tokens: int) -> None:
    """Token for token, logprobs within float tolerance (another shape may pick another kernel), in
    whole layers and in pieces (a long prompt's first piece graphed, the rest eager)."""
    dev = torch.device("cuda", 0)
    cfg = GPTConfig(layers=3, d_model=64, heads=4, seq_len=1024, vocab=512)
    eager = PrefillModel(cfg, seed=4).place(dev)
    graphed = PrefillModel(cfg, seed=4).place(dev).use_graphs()
    prompt = [(7 * i) % 512 for i in range(tokens)]
    for piece in (None, 256):
        runs = []
        for model in (eager, graphed):
            state = model.start(prompt)
            while not state.done:
                if piece is None:
                    model.run_layers(state, max_layers=1)
                else:
                    model.run_piece(state, piece)
            runs.append((state, model.finish(state, top_logprobs=5)))
        (s_e, r_e), (s_g, r_g) = runs
        assert r_g.token == r_e.token and [t for t, _ in r_g.top] == [t for t, _ in r_e.top]
        assert r_g.logprob == pytest.approx(r_e.logprob, abs=1e-4)
        for (k_e, v_e), (k_g, v_g) in zip(s_e.kv, s_g.kv, strict=True):
            assert (
                k_g.shape == k_e.shape and torch.allclose(k_g, k_e, atol=1e-4) and torch.allclose(v_g, v_e, atol=1e-4)
            )
    assert graphed.graphs is not None and graphed.graphs.captured() > 0

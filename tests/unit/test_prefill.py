import copy
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared.config.model_info import CheckpointError
from shared.config.spec import Prefill
from shared.config.training import ModelSpec
from shared.model.causal import CausalLM
from shared.model.families.nanogpt import NanoGPT
from shared.model.gpt import Block, build_full, build_stage
from shared.model.prefill import PrefillModel, PrefillResult, PrefillState, kv_bytes, sample, save_checkpoint
from shared.model.shape import GPTConfig, estimate_kv_bytes, model_info
from shared.model.tokenizer import BYTES, decode, encode

CFG = GPTConfig(layers=4, d_model=32, heads=4, seq_len=64, vocab=256)
SEED = 7
PROMPTS = [
    encode("Hello, world"),
    encode("a"),
    list(range(CFG.seq_len)),  # exactly seq_len tokens
    torch.randint(0, CFG.vocab, (23,), generator=torch.Generator().manual_seed(3)).tolist(),
]


@pytest.fixture(scope="module")
def model() -> PrefillModel:
    return PrefillModel(CFG, SEED)


def assert_same(a: PrefillResult, b: PrefillResult) -> None:
    assert (a.token, a.text, a.logprob, a.top, a.prompt_tokens) == (b.token, b.text, b.logprob, b.top, b.prompt_tokens)
    assert len(a.kv) == len(b.kv) == CFG.layers
    for (ka, va), (kb, vb) in zip(a.kv, b.kv, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def run_to_end(model: PrefillModel, state: PrefillState, should_stop: Callable[[], bool]) -> PrefillState:
    for _ in range(10 * CFG.layers):  # every pattern below makes progress at least every few calls
        if state.done:
            return state
        before = state.next_layer
        model.run_layers(state, should_stop=should_stop)
        assert state.next_layer >= before
    raise AssertionError("prefill made no progress")


def one_block_per_call() -> Callable[[], bool]:
    """A should_stop that lets one block run, then stops at the next boundary (and so on)."""
    calls = [0]

    def stop() -> bool:
        calls[0] += 1
        return calls[0] % 2 == 0

    return stop


def coin_flips(seed: int) -> Callable[[], bool]:
    """A should_stop that stops at random boundaries (a seeded fair coin per call)."""
    rng = random.Random(seed)
    return lambda: rng.random() < 0.5


# --- (a) split equivalence ------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", PROMPTS, ids=["hello", "one", "full", "random"])
def test_any_split_equals_one_uninterrupted_pass(model: PrefillModel, tokens: list[int]) -> None:
    whole = model.prefill(tokens, top_logprobs=5)
    finish = {"top_logprobs": 5}

    # Stop after every layer, via should_stop.
    state = run_to_end(model, model.start(tokens), should_stop=one_block_per_call())
    assert_same(model.finish(state, **finish), whole)

    # Stop at random layer boundaries (including before any block), several times over.
    for seed in range(5):
        state = run_to_end(model, model.start(tokens), should_stop=coin_flips(seed))
        assert_same(model.finish(state, **finish), whole)

    # max_layers=1 repeatedly: exactly one block per call.
    state = model.start(tokens)
    for i in range(CFG.layers):
        model.run_layers(state, max_layers=1)
        assert state.next_layer == i + 1 and len(state.kv) == i + 1
    assert_same(model.finish(state, **finish), whole)

    # Resume on deep copies: the copy finishes identically and the original is not disturbed.
    for stop_at in range(CFG.layers + 1):
        state = model.run_layers(model.start(tokens), max_layers=stop_at)
        snapshot = copy.deepcopy(state)
        model.run_layers(snapshot)
        assert state.next_layer == stop_at and snapshot.done
        assert_same(model.finish(snapshot, **finish), whole)
        assert_same(model.finish(model.run_layers(state), **finish), whole)


def test_should_stop_is_checked_before_each_block(model: PrefillModel) -> None:
    calls: list[int] = []
    state = model.start(encode("abc"))

    def never() -> bool:
        calls.append(state.next_layer)
        return False

    model.run_layers(state, max_layers=2, should_stop=never)
    assert calls == [0, 1]  # not consulted again once max_layers blocks ran
    model.run_layers(state, should_stop=never)
    assert calls == [0, 1, 2, 3] and state.done

    fresh = model.start(encode("abc"))
    assert model.run_layers(fresh, should_stop=lambda: True) is fresh  # mutated in place and returned
    assert fresh.next_layer == 0 and fresh.kv == [] and fresh.hidden is not None  # embeddings only
    assert fresh.hidden.shape == (1, 3, CFG.d_model)
    done = model.run_layers(fresh)
    assert model.run_layers(done, should_stop=lambda: pytest.fail("a done state runs nothing")).done


# --- (b) agreement with the training model ---------------------------------------------------------


@pytest.mark.parametrize("tokens", PROMPTS, ids=["hello", "one", "full", "random"])
def test_logits_and_kv_match_the_training_model(model: PrefillModel, tokens: list[int]) -> None:
    full = build_full(CFG, SEED)
    ids = torch.tensor([tokens])  # (1, T)
    T, C, nh = len(tokens), CFG.d_model, CFG.heads
    state = model.run_layers(model.start(tokens))
    with torch.no_grad():
        expected = full(ids)[0, -1]  # (vocab,)
        torch.testing.assert_close(model.last_logits(state), expected, rtol=0, atol=1e-6)
        assert full.wte is not None and full.wpe is not None
        x = full.wte(ids) + full.wpe(torch.arange(T))  # (1, T, C)
        for i, block in enumerate(full.blocks):
            assert isinstance(block, Block)
            _, k, v = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)  # 2 x (1, T, C)
            k = k.view(1, T, nh, C // nh).transpose(1, 2)  # (1, nh, T, hs)
            v = v.view(1, T, nh, C // nh).transpose(1, 2)  # (1, nh, T, hs)
            assert state.kv[i][0].shape == (1, nh, T, C // nh)
            assert torch.equal(state.kv[i][0], k) and torch.equal(state.kv[i][1], v)
            x = block(x)
        assert state.hidden is not None and torch.equal(state.hidden, x)  # forward_kv is bit-identical to forward


def test_block_forward_kv_equals_forward_for_batches() -> None:
    block = build_full(CFG, SEED).blocks[1]
    assert isinstance(block, Block)
    x = torch.randn(3, 10, CFG.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y, k, v = block.forward_kv(x)
        assert torch.equal(y, block(x))
    assert k.shape == v.shape == (3, CFG.heads, 10, CFG.d_model // CFG.heads)
    assert k.is_contiguous() and v.is_contiguous()


# --- (c) decoding ---------------------------------------------------------------------------------


def test_greedy_sampling_logprob_and_top(model: PrefillModel) -> None:
    tokens = encode("The cat sat on the")
    state = model.run_layers(model.start(tokens))
    logits = model.last_logits(state)
    logprobs = F.log_softmax(logits, dim=-1)

    greedy = model.finish(state, top_logprobs=10)
    assert greedy.token == int(logits.argmax()) == model.prefill(tokens).token
    assert greedy.text == decode([greedy.token]) and greedy.prompt_tokens == len(tokens)
    assert greedy.logprob <= 0 and greedy.logprob == float(logprobs[greedy.token])
    assert len(greedy.top) == 10 and greedy.top[0] == (greedy.token, greedy.logprob)
    assert [lp for _, lp in greedy.top] == sorted((lp for _, lp in greedy.top), reverse=True)
    assert all(lp == float(logprobs[i]) for i, lp in greedy.top)
    assert model.finish(state, top_logprobs=1000).top[-1][0] == int(logits.argmin())  # capped at vocab
    assert model.finish(state).top == []
    assert model.finish(state, temperature=1e-30, seed=0).token == greedy.token  # no nan at tiny temperatures

    rng_before = torch.get_rng_state()
    samples = [model.finish(state, temperature=1.0, seed=s) for s in range(20)]
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    assert [r.token for r in samples] == [model.finish(state, temperature=1.0, seed=s).token for s in range(20)]
    assert len({r.token for r in samples}) > 1
    for r in samples:
        assert r.logprob <= 0 and r.logprob == float(logprobs[r.token])
    assert state.done and len(state.kv) == CFG.layers  # finish leaves the state as it was


def test_ids_beyond_bytes_decode_to_replacement_char() -> None:
    model = PrefillModel(GPTConfig(layers=2, d_model=16, heads=2, seq_len=8, vocab=300), 0)
    with torch.no_grad():  # make id 299 win: ln_f output + 1, and 299's head row all ones
        assert model.module.ln_f is not None and model.module.lm_head is not None
        model.module.ln_f.bias.fill_(1.0)
        model.module.lm_head.weight[299].fill_(1.0)
    result = model.prefill([299, 5])
    assert (result.token, result.text) == (299, "\ufffd")


# --- (d) bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([], "prompt is empty"),
        ([1, 256], "token 256 at position 1 is not an id in 0..255"),
        ([-1], "token -1 at position 0"),
        ([1.5], "token 1.5 at position 0"),
        (list(range(CFG.seq_len + 1)), "65 tokens, more than this model's limit of 64"),
    ],
)
def test_bad_prompts_are_refused(model: PrefillModel, tokens: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.start(tokens)
    with pytest.raises(ValueError, match=message):
        model.prefill(tokens)


def test_misuse_is_refused(model: PrefillModel) -> None:
    state = model.run_layers(model.start(encode("hi")), max_layers=2)
    with pytest.raises(ValueError, match="not finished: 2 of 4 layers"):
        model.finish(state)
    with pytest.raises(ValueError, match="max_layers"):
        model.run_layers(state, max_layers=-1)
    other = PrefillModel(GPTConfig(layers=2, d_model=32, heads=4, seq_len=64, vocab=256), SEED)
    with pytest.raises(ValueError, match="this model has 2 layers"):
        other.run_layers(state)
    done = model.run_layers(state)
    with pytest.raises(ValueError, match="temperature"):
        model.finish(done, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        model.finish(done, temperature=float("nan"))
    with pytest.raises(ValueError, match="top_logprobs"):
        model.finish(done, top_logprobs=-1)


# --- (e) checkpoints and the spec -----------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    seeded = PrefillModel(CFG, 1)
    save_checkpoint(seeded, path)
    loaded = PrefillModel.from_checkpoint(path, CFG)
    for name, p in seeded.module.state_dict().items():
        assert torch.equal(p, loaded.module.state_dict()[name])
    for tokens in PROMPTS:
        assert_same(loaded.prefill(tokens, top_logprobs=3), seeded.prefill(tokens, top_logprobs=3))
    assert PrefillModel(CFG, SEED).prefill(PROMPTS[3]).logprob != loaded.prefill(PROMPTS[3]).logprob

    spec = ModelSpec(layers=4, d_model=32, heads=4, seq_len=64, vocab=256, seed=SEED)  # seed unused with a file
    from_file = PrefillModel.from_spec(Prefill(model=spec, checkpoint=str(path)))
    assert_same(from_file.prefill(PROMPTS[0]), seeded.prefill(PROMPTS[0]))
    from_seed = PrefillModel.from_spec(Prefill(model=spec, max_prompt_tokens=5))
    assert_same(from_seed.prefill(PROMPTS[0][:5]), PrefillModel(CFG, SEED).prefill(PROMPTS[0][:5]))
    with pytest.raises(ValueError, match="limit of 5"):
        from_seed.start(PROMPTS[0][:6])


class NotAStateDict:
    pass


def test_bad_checkpoints_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.pt"
    sd = build_full(CFG, 1).state_dict()
    del sd["ln_f.weight"]
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"bad\.pt.*missing keys \['ln_f\.weight'\]"):
        PrefillModel.from_checkpoint(path, CFG)

    sd = build_full(CFG, 1).state_dict()
    sd["extra.weight"] = torch.zeros(1)
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"unexpected keys \['extra\.weight'\]"):
        PrefillModel.from_checkpoint(path, CFG)

    save_checkpoint(build_full(GPTConfig(layers=4, d_model=16, heads=4, seq_len=64, vocab=256), 1), path)
    with pytest.raises(CheckpointError, match=r"wte\.weight has shape \(256, 16\), expected \(256, 32\)"):
        PrefillModel.from_checkpoint(path, CFG)

    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="holds a list, not a state_dict"):
        PrefillModel.from_checkpoint(path, CFG)
    torch.save({"obj": NotAStateDict()}, path)  # needs pickled code: weights_only refuses it
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        PrefillModel.from_checkpoint(path, CFG)
    with pytest.raises(CheckpointError, match="cannot load checkpoint"):
        PrefillModel.from_checkpoint(tmp_path / "absent.pt", CFG)
    with pytest.raises(ValueError, match="only a full model"):
        save_checkpoint(build_stage(CFG, 1, 0, 2), path)


# --- (f) memory accounting ------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", PROMPTS, ids=["hello", "one", "full", "random"])
def test_estimate_kv_bytes_equals_real_size(model: PrefillModel, tokens: list[int]) -> None:
    state = model.run_layers(model.start(tokens), max_layers=1)
    assert kv_bytes(state) == estimate_kv_bytes(CFG, len(tokens)) // CFG.layers  # one layer so far
    result = model.finish(model.run_layers(state))
    assert kv_bytes(result) == kv_bytes(state) == estimate_kv_bytes(CFG, len(tokens))
    assert estimate_kv_bytes(CFG, len(tokens)) == 2 * CFG.layers * len(tokens) * CFG.d_model * 4
    info = model_info(Prefill(model=ModelSpec(layers=4, d_model=32, heads=4, seq_len=64, vocab=256)))
    assert info == model.info == CFG.info() and info.family == "nanogpt" and info.max_model_len == 64
    assert info.kv_bytes(len(tokens)) == estimate_kv_bytes(CFG, len(tokens)) == kv_bytes(result)


# --- (g) the CausalLM interface, decoding with the cache, sampling ------------------------------


def test_the_nanogpt_is_a_causal_lm_with_the_training_models_weights(model: PrefillModel) -> None:
    lm = model.module
    assert isinstance(lm, CausalLM) and isinstance(lm, NanoGPT) and model.layers == CFG.layers
    full = build_full(CFG, SEED)
    assert all(torch.equal(p, full.state_dict()[n]) for n, p in lm.state_dict().items())
    again = PrefillModel(NanoGPT(CFG, SEED))  # from a CausalLM: the same model
    assert_same(again.prefill(PROMPTS[0], top_logprobs=3), model.prefill(PROMPTS[0], top_logprobs=3))
    with pytest.raises(ValueError, match="state_dict is for a nanoGPT"):
        PrefillModel(NanoGPT(CFG, SEED), state_dict=full.state_dict())
    assert model.device == torch.device("cpu") and model.tokenizer is BYTES


@pytest.mark.parametrize("tokens", PROMPTS[:2] + PROMPTS[3:], ids=["hello", "one", "random"])
def test_decode_steps_equal_prefills_of_the_longer_prompt(model: PrefillModel, tokens: list[int]) -> None:
    """Each decode step's logits and grown cache are what a prefill of the prompt so far computes."""
    first = model.prefill(tokens)
    seq, kv = [*tokens, first.token], first.kv
    for _ in range(4):
        logits, grown = model.decode_step(kv, seq[-1], len(seq) - 1)
        again = model.run_layers(model.start(seq))
        assert torch.allclose(logits, model.last_logits(again), atol=1e-5, rtol=0)
        for (k, v), (k2, v2) in zip(grown, again.kv, strict=True):
            assert k.shape == k2.shape == (1, CFG.heads, len(seq), CFG.d_model // CFG.heads)
            assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
        assert kv[0][0].shape[2] == len(seq) - 1  # the cache given is not changed
        seq.append(sample(logits, 0.0))
        kv = grown


def test_decode_step_refuses_what_does_not_fit(model: PrefillModel) -> None:
    first = model.prefill(encode("hi"))
    with pytest.raises(ValueError, match=r"expected \(1, 4, 3, 8\) \(positions 0\.\.2\)"):
        model.decode_step(first.kv, first.token, 3)
    with pytest.raises(ValueError, match="the cache has 1 layers, this model 4"):
        model.decode_step(first.kv[:1], first.token, 2)
    with pytest.raises(ValueError, match=r"token 256 is not an id in 0\.\.255"):
        model.decode_step(first.kv, 256, 2)
    with pytest.raises(ValueError, match=r"position 64 is outside the model's 0\.\.63"):
        model.decode_step(first.kv, 1, CFG.seq_len)


def test_sample_is_the_rule_finish_uses(model: PrefillModel) -> None:
    state = model.run_layers(model.start(encode("The cat sat on the")))
    logits = model.last_logits(state)
    assert sample(logits, 0.0) == int(logits.argmax())
    rng_before = torch.get_rng_state()
    for s in range(10):
        token = sample(logits, 0.8, seed=s)
        assert token == model.finish(state, temperature=0.8, seed=s).token
        assert token == sample(logits, 0.8, generator=torch.Generator().manual_seed(s))
    assert torch.equal(torch.get_rng_state(), rng_before)  # the global RNG is left alone
    assert sample(logits, 1e-30, seed=0) == int(logits.argmax())
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, -0.5)


def test_a_warm_up_changes_no_answer_and_fits_any_model() -> None:
    """`warm_up` (a worker runs it at set-up, so a first request does not pay for the process's
    first forward) computes a prompt at most the model's limit long, and leaves nothing behind: a
    warmed model answers exactly as a cold one."""
    warmed, cold = PrefillModel(CFG, SEED), PrefillModel(CFG, SEED)
    assert warmed.warm_up(tokens=10 * CFG.seq_len) > 0  # past seq_len: clamped, not refused
    for tokens in PROMPTS:
        assert_same(warmed.prefill(tokens), cold.prefill(tokens))

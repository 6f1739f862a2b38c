import pytest
import torch

from shared.config.training import ModelSpec
from shared.model.data import ByteCorpus, decode, encode
from shared.model.gpt import StageModule, build_full, build_stage, lm_loss
from shared.model.reference import train_reference
from shared.model.shape import GPTConfig, split_layers

CFG = GPTConfig(layers=4, d_model=32, heads=4, seq_len=16, vocab=256)
SEED = 7
TINY_TEXT = b"the quick brown fox jumps over the lazy dog. " * 20


def tokens(batch: int = 3, seq_len: int = CFG.seq_len, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab, (batch, seq_len), generator=g)


def stages_of(n: int) -> list[StageModule]:
    return [build_stage(CFG, SEED, s, n) for s in range(n)]


# --- split_layers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "expected"),
    [
        (4, 1, [(0, 4)]),
        (4, 2, [(0, 2), (2, 4)]),
        (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        (5, 2, [(0, 3), (3, 5)]),
        (7, 3, [(0, 3), (3, 5), (5, 7)]),
        (1, 1, [(0, 1)]),
    ],
)
def test_split_layers(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    assert split_layers(layers, stages) == expected


@pytest.mark.parametrize(("layers", "stages"), [(4, 5), (4, 0), (4, -1)])
def test_split_layers_rejects_bad_stage_counts(layers: int, stages: int) -> None:
    with pytest.raises(ValueError):
        split_layers(layers, stages)


# --- config and stages ----------------------------------------------------------------------------


def test_config_from_spec_and_validation() -> None:
    cfg = GPTConfig.from_spec(ModelSpec(layers=3, d_model=48, heads=6, seq_len=32, vocab=300, seed=5))
    assert cfg == GPTConfig(layers=3, d_model=48, heads=6, seq_len=32, vocab=300)
    with pytest.raises(ValueError, match="multiple of heads"):
        GPTConfig(layers=2, d_model=30, heads=4, seq_len=8, vocab=256)


def test_stage_ownership() -> None:
    first, middle, last = (build_stage(CFG, SEED, s, 3) for s in range(3))
    assert first.is_first and not first.is_last and first.wte is not None and first.lm_head is None
    assert not middle.is_first and not middle.is_last and middle.wte is None and middle.ln_f is None
    assert last.is_last and last.ln_f is not None and last.lm_head is not None and last.wpe is None
    assert [m.layer_range for m in (first, middle, last)] == [(0, 2), (2, 3), (3, 4)]
    full = build_full(CFG, SEED)
    assert full.is_first and full.is_last and len(full.blocks) == CFG.layers
    with pytest.raises(ValueError):
        build_stage(CFG, SEED, 3, 3)


def test_forward_shapes_and_input_checks() -> None:
    first, last = stages_of(2)
    h = first(tokens(batch=2, seq_len=5))
    assert h.shape == (2, 5, CFG.d_model) and h.dtype == torch.float32
    assert last(h).shape == (2, 5, CFG.vocab)
    with pytest.raises(ValueError, match="seq_len"):
        first(tokens(seq_len=CFG.seq_len + 1))
    with pytest.raises(ValueError):
        last(tokens())  # token ids into a middle/last stage


def test_no_weight_tying() -> None:
    full = build_full(CFG, SEED)
    assert full.wte is not None and full.lm_head is not None
    assert full.wte.weight.data_ptr() != full.lm_head.weight.data_ptr()


@pytest.mark.parametrize("n", [2, 4])
def test_stage_parameters_equal_full_model(n: int) -> None:
    full = dict(build_full(CFG, SEED).named_parameters())
    seen: set[str] = set()
    for stage in stages_of(n):
        for name, p in stage.global_named_parameters():
            assert torch.equal(p, full[name]), name
            seen.add(name)
    assert seen == set(full)  # the stages together own every parameter exactly once


def test_init_values_and_seeds() -> None:
    before = torch.random.get_rng_state()
    full = build_full(CFG, SEED)
    assert torch.equal(torch.random.get_rng_state(), before)  # the global RNG is not touched
    params = dict(full.named_parameters())
    assert torch.equal(params["blocks.0.ln_1.weight"], torch.ones(CFG.d_model))
    assert torch.equal(params["blocks.0.attn.c_attn.bias"], torch.zeros(3 * CFG.d_model))
    assert abs(params["wte.weight"].std().item() - 0.02) < 0.002
    again = dict(build_full(CFG, SEED).named_parameters())
    other = dict(build_full(CFG, SEED + 1).named_parameters())
    assert all(torch.equal(params[k], again[k]) for k in params)
    assert not torch.equal(params["wte.weight"], other["wte.weight"])


@pytest.mark.parametrize("n", [2, 4])
def test_composed_stages_equal_full_logits(n: int) -> None:
    x = tokens()
    full = build_full(CFG, SEED)
    with torch.no_grad():
        expected = full(x)
        h = x
        for stage in stages_of(n):
            h = stage(h)
    assert h.shape == (3, CFG.seq_len, CFG.vocab)
    assert torch.equal(h, expected)


@pytest.mark.parametrize("n", [2, 4])
def test_stage_by_stage_backward_equals_full_gradients(n: int) -> None:
    x = tokens()
    y = tokens(seed=1)
    full = build_full(CFG, SEED)
    lm_loss(full(x), y).backward()
    full_grads = {name: p.grad for name, p in full.named_parameters()}

    stages = stages_of(n)
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    h = x
    for stage in stages:  # forward, cutting the graph between stages as the pipeline does
        inp = h if stage.is_first else h.detach().requires_grad_(True)
        out = stage(inp)
        inputs.append(inp)
        outputs.append(out)
        h = out
    lm_loss(outputs[-1], y).backward()
    for s in range(n - 2, -1, -1):  # backward, passing each stage the gradient of its output
        grad = inputs[s + 1].grad
        assert grad is not None
        outputs[s].backward(grad)

    for stage in stages:
        for name, p in stage.global_named_parameters():
            expected = full_grads[name]
            assert p.grad is not None and expected is not None, name
            torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-6, msg=name)


# --- data -----------------------------------------------------------------------------------------


def test_tokenizer_round_trip() -> None:
    text = "hello, wörld — 你好 🍵\n"
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode(torch.tensor(ids)) == text
    assert decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not an error
    with pytest.raises(ValueError):
        decode([256])


def test_batch_is_deterministic_and_shifted() -> None:
    corpus = ByteCorpus.from_bytes(TINY_TEXT + bytes(range(256)))
    before = torch.random.get_rng_state()
    x, y = corpus.batch(3, 5, 4, 16, seed=11)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    x2, y2 = corpus.batch(3, 5, 4, 16, seed=11)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    data = corpus.data.long()
    for row_x, row_y in zip(x, y, strict=True):  # every row is a real window with its next-byte targets
        assert any(
            torch.equal(data[i : i + 16], row_x) and torch.equal(data[i + 1 : i + 17], row_y)
            for i in range(len(corpus) - 16)
        )
    for it, index, seed in ((3, 6, 11), (4, 5, 11), (3, 5, 12)):  # change any one of (iteration, index, seed)
        assert not torch.equal(x, corpus.batch(it, index, 4, 16, seed)[0])


def test_batch_rejects_short_corpus() -> None:
    with pytest.raises(ValueError, match="too short"):
        ByteCorpus.from_bytes(b"abc").batch(0, 0, 1, 3, 0)
    with pytest.raises(ValueError):
        ByteCorpus.from_bytes(b"a")


def test_stdlib_corpus() -> None:
    a = ByteCorpus.from_stdlib(max_bytes=50_000)
    b = ByteCorpus.from_stdlib(max_bytes=50_000)
    assert len(a) == 50_000 and a.data.dtype == torch.uint8
    assert torch.equal(a.data, b.data) and a.fingerprint() == b.fingerprint()
    assert "import" in decode(a.data)


# --- reference training ---------------------------------------------------------------------------


def test_train_reference_learns_and_is_deterministic() -> None:
    corpus = ByteCorpus.from_bytes(TINY_TEXT)

    def run() -> list[float]:
        # lr 3e-3: over 100 (seed, data_seed) pairs the drop was always > 0.27; at lr 1e-2 AdamW's
        # first sign-like steps overshoot for about 1 seed in 100 and the loss can rise.
        return train_reference(
            CFG, corpus, seed=SEED, data_seed=3, lr=3e-3, iterations=3, dp=2, microbatches=2, microbatch_size=8
        )

    losses = run()
    assert len(losses) == 3
    assert abs(losses[0] - torch.log(torch.tensor(256.0)).item()) < 0.5  # starts near uniform
    assert losses[-1] < losses[0] - 0.1
    assert run() == losses

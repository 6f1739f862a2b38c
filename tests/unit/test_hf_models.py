"""Hugging Face checkpoints served by our own model code, held to transformers as the reference.

For each family (GPT-2 tied and untied, Llama, Mistral, Qwen2) a tiny randomly initialised model is
built with transformers, saved with `save_pretrained` (safetensors) beside a small byte-level BPE
`tokenizer.json`, and loaded with `load_causal_lm` / `PrefillModel.from_spec`. Ours must give the
same logits (every position), the same greedy first token, the same KV cache per layer, the same
tokens decoding step by step with the cache, and a prefill split at layer boundaries must equal one
pass exactly. Bad directories fail at load, saying what was found and what is supported.

transformers is a test-only dependency: the product never imports it (checked below).
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from shared.config.model_info import CheckpointError
from shared.config.spec import Prefill
from shared.model.checkpoint import load_causal_lm
from shared.model.prefill import PrefillModel, PrefillState, kv_bytes
from shared.model.shape import model_info
from shared.model.tokenizer import HFTokenizer, tokenizer_for

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 300
TOKENIZER_VOCAB = 290  # the model's embedding is padded past the tokenizer's ids, as real ones often are
TOL = 1e-4
PROMPT = [5, 17, 260, 3, 99, 281, 42, 7, 7, 150, 201]
LLAMA_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: two query heads per kv head
    max_position_embeddings=128,
    bos_token_id=0,
    eos_token_id=1,
)
GPT2_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=1
)

#: name -> (transformers class, its config), each a different variant of a family.
CASES: dict[str, Callable[[], tuple[type[PreTrainedModel], Any]]] = {
    "gpt2-tied": lambda: (GPT2LMHeadModel, GPT2Config(**GPT2_SHAPE)),  # gelu_new, lm_head = wte
    "gpt2-untied": lambda: (
        GPT2LMHeadModel,
        GPT2Config(
            **GPT2_SHAPE, activation_function="gelu", tie_word_embeddings=False, scale_attn_by_inverse_layer_idx=True
        ),
    ),
    "llama": lambda: (
        LlamaForCausalLM,
        LlamaConfig(**LLAMA_SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}),
    ),
    "llama-tied-bias-llama3rope": lambda: (
        LlamaForCausalLM,
        LlamaConfig(
            **LLAMA_SHAPE,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral": lambda: (MistralForCausalLM, MistralConfig(**LLAMA_SHAPE, sliding_window=None)),
    "qwen2": lambda: (Qwen2ForCausalLM, Qwen2Config(**LLAMA_SHAPE)),  # q/k/v biases
}


def byte_bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme) trained on a few sentences: 256 bytes, 2 specials, 32 merges."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["bubble tea, hello"] * 10, trainer)
    return tok


def random_init(model: PreTrainedModel) -> PreTrainedModel:
    """Every parameter random (transformers initialises norms to 1 and biases to 0, which would hide
    a norm or bias we forgot); seeded, so each model is the same every run."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = name.endswith("weight") and ("norm" in name or "ln_" in name)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if is_norm else 0.0))
    return model.eval()


@dataclass
class Saved:
    name: str
    hf: PreTrainedModel
    path: Path


def save(name: str, directory: Path, **save_kw: Any) -> Saved:
    cls, config = CASES[name]()
    torch.manual_seed(0)
    hf = random_init(cls(config))
    hf.save_pretrained(directory, safe_serialization=True, **save_kw)
    byte_bpe_tokenizer().save(str(directory / "tokenizer.json"))
    return Saved(name, hf, directory)


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    return save(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def model(saved: Saved) -> PrefillModel:
    return PrefillModel.from_spec(Prefill(checkpoint=str(saved.path)))


def reference(saved: Saved, ids: list[int]) -> Any:
    with torch.no_grad():
        return saved.hf(torch.tensor([ids]), use_cache=True)


# --- the same function as transformers ------------------------------------------------------------


def test_logits_at_every_position_and_the_greedy_token_match(saved: Saved, model: PrefillModel) -> None:
    out = reference(saved, PROMPT)
    state = model.run_layers(model.start(PROMPT))
    assert state.hidden is not None
    with torch.inference_mode():
        ours = torch.stack([model.module.head(state.hidden[:, t, :]) for t in range(len(PROMPT))])  # (T, vocab)
    assert ours.shape == out.logits[0].shape == (len(PROMPT), VOCAB)
    assert torch.allclose(ours, out.logits[0], atol=TOL, rtol=0), (ours - out.logits[0]).abs().max()
    assert torch.equal(model.last_logits(state), ours[-1])
    result = model.finish(state, top_logprobs=3)
    assert result.token == int(out.logits[0, -1].argmax())
    assert result.top[0][0] == result.token


def test_kv_cache_matches_transformers_per_layer(saved: Saved, model: PrefillModel) -> None:
    out = reference(saved, PROMPT)
    result = model.prefill(PROMPT)
    info = model.info
    assert len(result.kv) == info.layers == len(out.cache.layers)
    for (k, v), theirs in zip(result.kv, out.cache.layers, strict=True):
        assert k.shape == v.shape == (1, info.kv_heads, len(PROMPT), info.head_dim) == theirs.keys.shape
        assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == torch.float32
        assert torch.allclose(k, theirs.keys, atol=TOL, rtol=0)
        assert torch.allclose(v, theirs.values, atol=TOL, rtol=0)
    assert kv_bytes(result) == info.kv_bytes(len(PROMPT))


def test_decode_steps_follow_transformers_token_for_token(saved: Saved, model: PrefillModel) -> None:
    """Greedy decoding with our cache equals transformers' forward with its cache, logits included."""
    first = model.prefill(PROMPT)
    out = reference(saved, PROMPT)
    past, theirs = out.cache, [int(out.logits[0, -1].argmax())]
    ours, kv = [first.token], first.kv
    for n in range(5):
        logits, grown = model.decode_step(kv, ours[-1], len(PROMPT) + n)
        assert len(grown) == model.info.layers and grown[0][0].shape[2] == len(PROMPT) + n + 1
        assert kv[0][0].shape[2] == len(PROMPT) + n  # the cache passed in is left as it was
        with torch.no_grad():
            out = saved.hf(torch.tensor([[theirs[-1]]]), cache=past, use_cache=True)
        past = out.cache
        assert torch.allclose(logits, out.logits[0, -1], atol=TOL, rtol=0)
        ours.append(int(logits.argmax()))
        theirs.append(int(out.logits[0, -1].argmax()))
        kv = grown
    assert ours == theirs
    for (k, v), layer in zip(kv, past.layers, strict=True):  # the grown cache is transformers' too
        assert torch.allclose(k, layer.keys, atol=TOL, rtol=0) and torch.allclose(v, layer.values, atol=TOL, rtol=0)


# --- resumable, exactly ---------------------------------------------------------------------------


def test_a_prefill_split_at_layer_boundaries_equals_one_pass(model: PrefillModel) -> None:
    whole = model.prefill(PROMPT, top_logprobs=5)
    rng = random.Random(3)
    for _ in range(3):
        state = model.start(PROMPT)
        model.run_layers(state, max_layers=0)  # embeddings only
        while not state.done:
            model.run_layers(state, max_layers=rng.randint(1, 2))
            copied = PrefillState(list(state.tokens), state.layers, state.next_layer, state.hidden, list(state.kv))
            state = copied  # resuming from a copy of the state is the same
        part = model.finish(state, top_logprobs=5)
        assert (part.token, part.text, part.logprob, part.top) == (whole.token, whole.text, whole.logprob, whole.top)
        for (ka, va), (kb, vb) in zip(part.kv, whole.kv, strict=True):
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_every_family_runs_in_bfloat16_as_a_guest_on_a_gpu_does(saved: Saved, model: PrefillModel) -> None:
    """`place(dtype=bfloat16)` (`shared.model.devices.guest_dtype` on a GPU), run here on the CPU: the
    float32 model's answer within bfloat16's rounding (its greedy token among the float32 top three,
    at that token's logprob: these random models have near-ties), float32 logits, bfloat16 KV
    caches, and a decode step after it."""
    want = model.prefill(PROMPT, top_logprobs=3)
    bf16 = PrefillModel.from_spec(Prefill(checkpoint=str(saved.path))).place(torch.device("cpu"), torch.bfloat16)
    state = bf16.run_layers(bf16.start(PROMPT))
    logits = bf16.last_logits(state)
    got = bf16.finish(state, top_logprobs=3)
    assert logits.dtype is torch.float32 and all(k.dtype is torch.bfloat16 for k, _ in got.kv)
    top = dict(want.top)
    assert got.token in top and got.logprob == pytest.approx(top[got.token], abs=0.25)
    step, grown = bf16.decode_step(got.kv, got.token, len(PROMPT))
    assert step.dtype is torch.float32 and len(grown) == len(got.kv)


# --- the spec: tokenizer, limits, shape without torch ---------------------------------------------


def test_from_spec_serves_with_the_checkpoints_tokenizer_and_limits(saved: Saved, model: PrefillModel) -> None:
    tok = model.tokenizer
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == TOKENIZER_VOCAB
    ids = tok.encode("the quick brown fox")
    assert tok.decode(ids) == "the quick brown fox" and len(ids) < len("the quick brown fox")  # merges used
    result = model.prefill(ids)
    assert result.text == (tok.decode([result.token]) if result.token < TOKENIZER_VOCAB else "\ufffd")
    info = model_info(Prefill(checkpoint=str(saved.path)))  # torch-free, from config.json
    assert info == model.info and info.family == saved.name.split("-")[0]
    assert info.max_model_len == (64 if saved.name.startswith("gpt2") else 128)
    assert model.max_tokens == info.max_model_len  # the default max_prompt_tokens (512) is larger
    limited = PrefillModel(model.module, max_prompt_tokens=5, tokenizer=tok)
    assert limited.max_tokens == 5
    with pytest.raises(ValueError, match="more than this model's limit of 5"):
        limited.start(PROMPT)
    with pytest.raises(ValueError, match=rf"not an id in 0\.\.{VOCAB - 1}"):
        model.start([VOCAB])
    with pytest.raises(ValueError, match=rf"position {info.max_model_len} is outside"):
        model.decode_step(result.kv, 1, info.max_model_len)


def test_the_device_follows_the_weights(model: PrefillModel) -> None:
    assert model.device == torch.device("cpu")
    assert all(p.device == model.device for p in model.module.parameters())
    assert all(b.device == model.device for b in model.module.buffers())
    assert not any(p.requires_grad for p in model.module.parameters()) and not model.module.training


# --- one family's details -------------------------------------------------------------------------


def test_mistral_sliding_window_is_applied(tmp_path: Path) -> None:
    """A prompt longer than Mistral's window: transformers masks keys beyond it, and so do we."""
    cls, config = CASES["mistral"]()
    config.sliding_window = 4
    torch.manual_seed(0)
    hf = random_init(cls(config))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = PrefillModel(load_causal_lm(tmp_path))
    with torch.no_grad():
        out = hf(torch.tensor([PROMPT]))
    state = model.run_layers(model.start(PROMPT))
    assert torch.allclose(model.last_logits(state), out.logits[0, -1], atol=TOL, rtol=0)
    full = PrefillModel(load_causal_lm(tmp_path))
    full.module.windows = [None] * full.info.layers  # type: ignore[assignment]  (the window off)
    unwindowed = full.last_logits(full.run_layers(full.start(PROMPT)))
    assert (unwindowed - out.logits[0, -1]).abs().max() > 1e-3  # so the window was exercised
    # decoding past the window: each step still equals transformers' full forward at that position
    first = model.finish(state)
    tokens, kv = [first.token], first.kv
    for n in range(3):
        logits, kv = model.decode_step(kv, tokens[-1], len(PROMPT) + n)
        tokens.append(int(logits.argmax()))
    with torch.no_grad():
        whole = hf(torch.tensor([PROMPT + tokens[:-1]])).logits[0]
    assert [int(t) for t in whole[len(PROMPT) - 1 :].argmax(-1)] == tokens


def test_a_sharded_checkpoint_loads(tmp_path: Path) -> None:
    one = save("qwen2", tmp_path / "one")
    sharded = save("qwen2", tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in sharded.path.glob("*.safetensors"))
    assert len(shards) > 2 and (sharded.path / "model.safetensors.index.json").is_file()
    a, b = PrefillModel(load_causal_lm(one.path)), PrefillModel(load_causal_lm(sharded.path))
    ra, rb = a.prefill(PROMPT, top_logprobs=5), b.prefill(PROMPT, top_logprobs=5)
    # bit-identical: the loader copies every tensor into fresh memory, so how the file laid the
    # tensors out (offsets, alignment) cannot change how the kernels round
    assert (ra.token, ra.logprob, ra.top) == (rb.token, rb.logprob, rb.top)
    for kv_a, kv_b in zip(ra.kv, rb.kv, strict=True):
        assert torch.equal(kv_a[0], kv_b[0]) and torch.equal(kv_a[1], kv_b[1])


def test_gpt2_names_without_the_transformer_prefix_and_old_mask_buffers_load(tmp_path: Path) -> None:
    """The original GPT-2 files name tensors without `transformer.` and carry attn.bias buffers."""
    saved = save("gpt2-tied", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = PrefillModel(load_causal_lm(tmp_path))
    out = reference(saved, PROMPT)
    assert torch.allclose(model.last_logits(model.run_layers(model.start(PROMPT))), out.logits[0, -1], atol=TOL)


# --- refusals, at load, saying what was found -----------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    return save("llama", tmp_path / "llama").path


def edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_missing_directory_or_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"absent does not exist \(nothing is ever downloaded\)"):
        load_causal_lm(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"has no config\.json \(found \['model\.safetensors'\]\)"):
        load_causal_lm(tmp_path / "empty")


def test_an_unsupported_model_type_is_refused_naming_the_supported_ones(llama_dir: Path) -> None:
    edit_config(llama_dir, model_type="bert")
    expected = r"model_type 'bert'; supported: gpt2, llama, mistral, qwen2"
    with pytest.raises(CheckpointError, match=expected):
        load_causal_lm(llama_dir)
    with pytest.raises(CheckpointError, match=expected):  # the front door and dispatcher refuse too
        model_info(Prefill(checkpoint=str(llama_dir)))


def test_missing_unexpected_and_misshaped_tensors_are_named(llama_dir: Path) -> None:
    path = llama_dir / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 8)
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_causal_lm(llama_dir)
    message = str(err.value)
    assert "missing tensors ['model.layers.1.mlp.up_proj.weight']" in message
    assert "model.layers.0.self_attn.q_proj.weight has shape (8, 8), expected (64, 64)" in message
    assert "unexpected tensors ['model.extra.weight']" in message
    assert "(llama, 3 layers, d_model 64, vocab 300)" in message


def test_no_weights_and_other_formats_are_refused(llama_dir: Path) -> None:
    (llama_dir / "model.safetensors").rename(llama_dir / "pytorch_model.bin")
    found = r"no safetensors weights .*found other weight files \['pytorch_model\.bin'\]: only safetensors are read"
    with pytest.raises(CheckpointError, match=found):
        load_causal_lm(llama_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"'rope_parameters' has rope_type 'yarn'; supp"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"'rope_scaling' has rope_t"),
        ({"partial_rotary_factor": 0.5}, r"'partial_rotary_factor' is 0\.5"),
        ({"hidden_act": "xielu"}, r"'hidden_act' is 'xielu'; supported: gelu"),
        ({"quantization_config": {"quant_method": "gptq"}}, r"'quantization_config'"),
        ({"model_type": "mistral", "attention_bias": True}, r"'attention_bias' is true: mistral has no such variant"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ],
)
def test_config_variants_we_do_not_implement_are_refused_naming_the_key(
    llama_dir: Path, changes: dict[str, Any], message: str
) -> None:
    edit_config(llama_dir, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(llama_dir)


def test_the_tokenizer_file_is_required_for_serving(llama_dir: Path) -> None:
    (llama_dir / "tokenizer.json").unlink()
    spec = Prefill(checkpoint=str(llama_dir))
    with pytest.raises(ValueError, match=r"has no tokenizer\.json"):
        tokenizer_for(spec)
    with pytest.raises(CheckpointError, match=r"has no tokenizer\.json"):
        PrefillModel.from_spec(spec)
    assert load_causal_lm(llama_dir).info.family == "llama"  # the model itself loads without it


# --- transformers stays a test dependency ---------------------------------------------------------


def test_the_product_never_imports_transformers() -> None:
    found = []
    for package in ("shared", "services", "bubbletea", "loadgen"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert found == []

"""What a training run refuses at start, each in one line naming the field, what was found and
what is expected: the model directory, its tokenizer, the data, the stage split, a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.config.spec import ConfigError, parse_spec
from shared.model.corpus import train_bpe_tokenizer
from shared.model.training import TrainingInputError, check_training
from shared.model.trainstate import ResumeError, SaveError, check_resume, check_save_target, trainer_state

LLAMA: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip
TEXT = "the pipeline has bubbles and the bubbles hold prefill work for the serving side " * 20


def model_dir(tmp_path: Path, vocab: int = 300, **config: Any) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**LLAMA, **config}))
    train_bpe_tokenizer([TEXT], vocab, d / "tokenizer.json")
    return d


def spec_for(directory: Path, data: list[str] | None = None, pp: int = 2, **training: Any) -> Any:
    return parse_spec(
        {
            "datacenters": [{"name": "a", "gpus": 2}],
            "model": {"seq_len": 16},
            "parallelism": {"pp": pp, "dp": 1},
            "training": {"model": str(directory), "data": data, **training},
        }
    )


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_the_models_shape_replaces_the_model_section(tmp_path: Path) -> None:
    spec = spec_for(model_dir(tmp_path))
    assert (spec.model.layers, spec.model.d_model, spec.model.heads, spec.model.vocab) == (2, 32, 4, 320)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "falcon"}, "training.model: config.json has model_type 'falcon'; supported: gpt2, llama"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope_type 'yarn'; supported: default, linear, llama3",
        ),
        (
            {"quantization_config": {"quant_method": "gptq"}},
            "'quantization_config': quantized weights are not supported",
        ),
    ],
)
def test_a_model_we_cannot_train_is_refused_naming_the_key(tmp_path: Path, config: Any, expected: str) -> None:
    d = model_dir(tmp_path, **config)
    with pytest.raises(ConfigError) as refused:
        check_training(spec_for(d))  # the spec may already refuse the type; check_training the rest
    assert expected in one_line(refused)


def test_a_tokenizer_that_does_not_match_the_vocabulary_is_refused(tmp_path: Path) -> None:
    d = model_dir(tmp_path, vocab=300, vocab_size=200)  # 256 byte tokens alone exceed it
    data = tmp_path / "a.txt"
    data.write_text(TEXT)
    with pytest.raises(TrainingInputError) as refused:
        check_training(spec_for(d, [str(data)]))
    assert "but the model's vocab_size is 200: the tokenizer does not match the model" in one_line(refused)


def test_missing_and_empty_data_files_are_refused(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    with pytest.raises(TrainingInputError) as refused:
        check_training(spec_for(d, [str(tmp_path / "nope.txt")]))
    assert "training.data:" in one_line(refused) and "nope.txt does not exist" in str(refused.value)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(TrainingInputError, match=r"training\.data: .*empty\.txt yields no tokens"):
        check_training(spec_for(d, [str(tmp_path / "empty.txt")]))
    with pytest.raises(ConfigError, match=r"training\.data: is empty"):
        spec_for(d, [])
    (tmp_path / "short.txt").write_text("the pipeline")
    with pytest.raises(TrainingInputError, match=r"fewer than one window of model\.seq_len \(16\) \+ 1"):
        check_training(spec_for(d, [str(tmp_path / "short.txt")]))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": 1}\n')
    with pytest.raises(TrainingInputError, match=r"bad\.jsonl line 2 has no 'text' field"):
        check_training(spec_for(d, [str(tmp_path / "bad.jsonl")]))


def test_a_model_past_redis_value_limit_per_stage_is_accepted_with_checkpoints(tmp_path: Path) -> None:
    """Checkpoints are files under BUBBLETEA_STATE_DIR, not Redis values: a stage whose state
    (about 16 B a parameter) is past Redis's 512 MB value limit trains with checkpoints."""
    d = model_dir(tmp_path, hidden_size=4096, intermediate_size=16384, num_hidden_layers=2, vocab_size=32000)
    check_training(spec_for(d))  # about 170 M parameters a stage: 2.7 GB of state


def test_a_split_that_leaves_a_stage_without_a_layer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        spec_for(model_dir(tmp_path), pp=3)
    assert "parallelism.pp: 3 stages would leave a stage without a layer: at most training.model's 2 layers" in (
        one_line(refused)
    )


def test_a_resume_from_another_model_or_split_is_refused(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    save = tmp_path / "save"
    (save / "optimizer").mkdir(parents=True)
    (save / "trainer_state.json").write_text(json.dumps(trainer_state(spec_for(d, iterations=10), 3)))
    for k in (1, 2):
        (save / "optimizer" / f"stage-{k:05d}-of-00002.safetensors").write_bytes(b"x")
    assert check_resume(save, spec_for(d, iterations=10)) == 3
    (tmp_path / "o").mkdir()
    other = model_dir(tmp_path / "o", hidden_size=64)
    with pytest.raises(ResumeError) as refused:
        check_resume(save, spec_for(other, iterations=10))
    assert "a checkpoint of another model: model.d_model is 64 here but 32 in the checkpoint" in one_line(refused)
    with pytest.raises(ResumeError, match=r"parallelism\.pp / split"):
        check_resume(save, spec_for(d, pp=1, iterations=10))
    with pytest.raises(ResumeError, match="nothing left to train"):
        check_resume(save, spec_for(d, iterations=4))
    with pytest.raises(ResumeError, match=r"has no trainer_state\.json"):
        check_resume(d, spec_for(d, iterations=10))


def test_a_save_never_replaces_a_directory_that_is_not_a_save(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SaveError) as refused:
        check_save_target(tmp_path)
    assert "it exists and is not a save" in one_line(refused)
    check_save_target(tmp_path / "new")  # new: fine
    (tmp_path / "empty").mkdir()
    check_save_target(tmp_path / "empty")  # empty: fine
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "trainer_state.json").write_text("{}")
    check_save_target(tmp_path / "earlier")  # an earlier save: replaced

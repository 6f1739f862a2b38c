"""What a spec trains, built the same way by the pipeline's stages and by the single-process reference.

* `build_training_stage(spec, stage)`: the small GPT's `StageModule` (no `training.model`) or a
  Hugging Face family's `HFStage` (`training.model`: its config.json, and its safetensors as the
  starting weights when there are any);
* `load_corpus(spec)`: the standard library's bytes, or `training.data` tokenized with the model
  directory's tokenizer.json (`TokenCorpus`);
* `check_training(spec)`: what the workers could not train, refused before anything starts;
* `tied_parameter`, `norm_parameters`: what a stage shares with another, and what counts in the
  global gradient norm (`shared.model.optim`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from shared.config.model_info import CheckpointError, info_from_config, read_config
from shared.config.spec import ClusterSpec, ConfigError
from shared.model.checkpoint import FAMILIES, checked_state, read_tensors
from shared.model.corpus import DataError, TokenCorpus
from shared.model.data import ByteCorpus
from shared.model.gpt import StageModule, build_stage
from shared.model.hf_stage import HFStage
from shared.model.shape import GPTConfig, stage_layer_ranges

TOKENIZER_FILE = "tokenizer.json"

Corpus = ByteCorpus | TokenCorpus
TrainingStage = StageModule | HFStage


def model_config(spec: ClusterSpec) -> dict[str, Any] | None:
    """The config.json of `training.model`, or None for the small GPT."""
    return None if spec.training.model is None else read_config(spec.training.model)


def has_weights(directory: str | Path) -> bool:
    d = Path(directory)
    return any(d.glob("*.safetensors"))


def build_training_stage(spec: ClusterSpec, stage: int) -> TrainingStage:
    """Stage `stage` of the spec's pipeline (see the module docstring), on the CPU."""
    config, ranges = model_config(spec), stage_layer_ranges(spec)
    if config is None:
        return build_stage(GPTConfig.from_spec(spec.model), spec.model.seed, stage, spec.parallelism.pp, ranges)
    directory = spec.training.model
    assert directory is not None
    weights = directory if has_weights(directory) else None
    return HFStage(config, stage=stage, ranges=ranges, seed=spec.model.seed, weights=weights)


class TrainingInputError(ConfigError):
    """`training.model` or `training.data` cannot be trained here; one line naming the field."""


def check_training(spec: ClusterSpec) -> None:
    """Refuse, before anything starts, what the workers could not train: a family, rope type,
    quantization or config variant the model code does not implement, weights that do not fit the
    config, a tokenizer that does not match the vocabulary, missing or empty data files. Each as a
    `TrainingInputError` of one line naming the field."""
    tr = spec.training
    if tr.model is None:
        return
    try:
        config = read_config(tr.model)
        info = info_from_config(config)
        lm = FAMILIES[config["model_type"]].from_config(config, info)  # on the meta device: refuses variants
        if has_weights(tr.model):
            checked_state(lm, read_tensors(Path(tr.model)), Path(tr.model))
    except CheckpointError as exc:
        raise TrainingInputError(f"training.model: {exc}") from None
    if tr.data is None:
        return
    try:  # tokenized here as the workers will: every refusal of corpus.py, once, before anything starts
        corpus = load_corpus(spec)
    except DataError as exc:
        raise TrainingInputError(str(exc)) from None
    if len(corpus) < spec.model.seq_len + 1:
        raise TrainingInputError(
            f"training.data: {len(corpus)} tokens in all, fewer than one window of model.seq_len "
            f"({spec.model.seq_len}) + 1: expected more text"
        )


def load_corpus(spec: ClusterSpec) -> Corpus:
    tr = spec.training
    if tr.data is None:
        return ByteCorpus.from_stdlib()
    assert tr.model is not None
    return TokenCorpus.from_files(tr.data, Path(tr.model) / TOKENIZER_FILE, vocab=spec.model.vocab)


def layer_count(model: nn.Module) -> int:
    """How many transformer layers a training stage holds."""
    if isinstance(model, HFStage):
        start, end = model.layer_range
        return end - start
    assert isinstance(model, StageModule)
    return len(model.blocks)


def config_json(spec: ClusterSpec) -> str:
    """The config.json a saved checkpoint of this run holds (float32 weights)."""
    config = model_config(spec)
    assert config is not None
    return json.dumps({**config, "torch_dtype": "float32", "dtype": "float32"}, indent=2, sort_keys=True) + "\n"


def tied_parameter(model: nn.Module) -> nn.Parameter | None:
    """The tied token embedding a stage shares with another stage (first and last of a pipeline
    whose head is tied), whose gradient the two sum each step; None otherwise."""
    if not isinstance(model, HFStage) or not model.tied or model.stages == 1:
        return None
    if not (model.is_first or model.is_last):
        return None
    weight = getattr(model.lm, model.lm.TIED_EMBEDDING).weight
    assert isinstance(weight, nn.Parameter)
    return weight


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradients count in the global norm: all, but the last stage's copy of a
    tied embedding (the first stage's counts it, once, as the single tensor of the whole model)."""
    if isinstance(model, HFStage):
        return [p for name, p in model.lm.named_parameters() if not model.is_tied_copy(name)]
    return list(model.parameters())


__all__ = [
    "Corpus",
    "TrainingInputError",
    "TrainingStage",
    "build_training_stage",
    "check_training",
    "config_json",
    "layer_count",
    "load_corpus",
    "model_config",
    "norm_parameters",
    "tied_parameter",
]

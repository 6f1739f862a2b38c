"""The checks every run command (demo, up, train, plan, simulate) runs at start, and `check-config`
runs alone, so that a spec `check-config` passes never fails a run at start (issue 37):

* the spec's fields and cross-field rules, and duplicate keys (`shared.config.spec.load_spec`);
* the environment's BUBBLETEA_* variables, each error naming its variable (`load_settings`, and
  here the ones that name files: BUBBLETEA_REDIS_SERVER, BUBBLETEA_RESUME);
* the placement of the stages on the datacenters (what `plan` and the workers compute);
* `prefill.checkpoint`: it exists, and its model loads as the workers will load it (a directory:
  its config.json's family and its tokenizer.json; a state_dict file: the weights, for `prefill.model`);
* `training.model` and `training.data`: what the workers would refuse to train
  (`shared.model.training.check_training`: the family, the weights, the tokenizer, the data files).
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.config.model_info import CheckpointError
from shared.config.settings import Settings
from shared.config.spec import ClusterSpec, ConfigError
from shared.policies.placement import PlacementError
from shared.runtime.redis_server import RedisServerError, find_redis_server


def check_run(settings: Settings) -> None:
    """Raise ConfigError, in one line naming the field or variable, for what a run of `settings`
    would refuse at start."""
    from shared.policies.pipeline_plan import placement_of

    spec = settings.base_spec or settings.spec
    source = settings.spec_path
    try:
        placement_of(spec)
    except PlacementError as exc:
        raise ConfigError(f"{source}: parallelism: {exc}") from None
    _check_prefill(spec, source)
    if spec.training.model is not None:  # torch is imported only then: 2 s of every command's start
        from shared.model.training import check_training

        try:
            check_training(spec)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    if os.environ.get("BUBBLETEA_REDIS_SERVER"):
        try:
            find_redis_server()
        except RedisServerError as exc:
            raise ConfigError(str(exc)) from None
    if settings.resume is not None:
        from shared.model.trainstate import check_resume

        try:
            check_resume(settings.resume, spec)
        except ConfigError as exc:
            raise ConfigError(f"BUBBLETEA_RESUME: {exc}") from None


def _check_prefill(spec: ClusterSpec, source: Path) -> None:
    checkpoint = spec.prefill.checkpoint
    if checkpoint is None:
        return
    if not Path(checkpoint).exists():
        raise ConfigError(
            f"{source}: prefill.checkpoint: {checkpoint} does not exist (expected a Hugging Face model directory, "
            "or a state_dict file of prefill.model's shape)"
        )
    # training may start from a config alone; serving needs weights
    if Path(checkpoint).is_dir() and not any(Path(checkpoint).glob("*.safetensors")):
        raise ConfigError(
            f"{source}: prefill.checkpoint: {checkpoint} has no weights (model.safetensors): prefill serves a "
            f"trained model; `bubbletea train --config {source} --save {checkpoint}` writes one, or "
            f"`bubbletea init-model {checkpoint} --weights` an untrained one"
        )
    try:
        if Path(checkpoint).is_dir():  # its family and tokenizer, without torch
            from shared.model.shape import model_info
            from shared.model.tokenizer import tokenizer_for

            model_info(spec.prefill)
            tokenizer_for(spec.prefill)
        else:  # a small nanoGPT's weights: loaded as the workers load them
            from shared.model.prefill import PrefillModel

            PrefillModel.from_spec(spec.prefill)
    except CheckpointError as exc:
        raise ConfigError(f"{source}: prefill.checkpoint: {exc}") from None

"""The directory `bubbletea train --save DIR` writes, and what `--resume DIR` checks before continuing.

DIR is a model others can use, plus what this project needs to continue training it:

* the model: for `training.model` a Hugging Face directory (`config.json` in float32,
  `model.safetensors`, the source directory's tokenizer files), which `transformers`
  `AutoModelForCausalLM.from_pretrained` and `prefill.checkpoint` load; for the small GPT its
  GPT-2 export (`shared.model.export`);
* ``optimizer/stage-<k>-of-<P>.safetensors``: each stage's trainer checkpoint (every trainable
  parameter and AdamW's moments and step count, the same bytes the run's recovery keeps in Redis);
* ``trainer_state.json``: the iteration trained last (the data position: every batch is a pure
  function of the iteration), the pipeline split and the model's shape.

A save is written into a sibling temporary directory and swapped in, so a reader never sees the
files of two iterations mixed. `check_resume` refuses, in one line naming the field, a directory
that is not such a save, or one of another model or split, or one that already has every iteration.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shared.config.spec import ClusterSpec, ConfigError
from shared.model.shape import stage_layer_ranges

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_DIR = "optimizer"
FORMAT = "bubbletea-train/1"


class SaveError(ConfigError):
    """`--save DIR` cannot write DIR; the message is one line saying why."""


class ResumeError(SaveError):
    """`--resume DIR` cannot continue from DIR; the message is one line saying why."""


def stage_file(stage: int, stages: int) -> str:
    return f"stage-{stage + 1:05d}-of-{stages:05d}.safetensors"


#: config.json keys that do not change the function a model computes (a save sets its own dtype).
NEUTRAL_CONFIG_KEYS = frozenset({"torch_dtype", "dtype", "transformers_version", "architectures", "_name_or_path"})


def model_identity(spec: ClusterSpec) -> dict[str, Any]:
    """What must match for a saved state to continue this spec's training: the family and shape,
    and for a Hugging Face model every config.json key that shapes its function."""
    m = spec.model
    identity: dict[str, Any] = {"family": "small-gpt", "layers": m.layers, "d_model": m.d_model, "heads": m.heads}
    identity["vocab"] = m.vocab
    if spec.training.model is not None:
        from shared.config.model_info import read_config

        config = read_config(spec.training.model)
        identity["family"] = config["model_type"]
        identity["config"] = {k: v for k, v in sorted(config.items()) if k not in NEUTRAL_CONFIG_KEYS}
    return identity


def trainer_state(spec: ClusterSpec, iteration: int) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "iteration": iteration,
        "next_iteration": iteration + 1,
        "pp": spec.parallelism.pp,
        "dp": spec.parallelism.dp,
        "stage_ranges": [list(r) for r in stage_layer_ranges(spec)],
        "model": model_identity(spec),
        "seq_len": spec.model.seq_len,
        "data_seed": spec.training.seed,
    }


def write_save(
    directory: str | Path,
    spec: ClusterSpec,
    iteration: int,
    write_model: Callable[[Path], object],
    stage_states: Sequence[bytes],
) -> Path:
    """Write a save of `iteration` to `directory` (see the module docstring); `write_model` writes
    the model's files into the directory it is given."""
    target = Path(directory)
    check_save_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"  # two writers (a periodic save, a stop) never share one
    tmp, old = target.with_name(f".{target.name}.{unique}.tmp"), target.with_name(f".{target.name}.{unique}.old")
    tmp.mkdir()
    try:
        write_model(tmp)
        (tmp / OPTIMIZER_DIR).mkdir()
        for k, blob in enumerate(stage_states):
            (tmp / OPTIMIZER_DIR / stage_file(k, len(stage_states))).write_bytes(blob)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state(spec, iteration), indent=2) + "\n")
        for path in [tmp, *tmp.rglob("*")]:  # readable by a server running as another user
            path.chmod(0o755 if path.is_dir() else 0o644)
        if target.exists():
            target.rename(old)
        try:
            tmp.rename(target)
        except OSError:
            if old.exists():  # put the previous save back rather than leave none
                old.rename(target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_save_target(directory: Path) -> None:
    """`--save DIR` replaces DIR whole: refuse a DIR that holds something other than a save."""
    if directory.exists() and (
        not directory.is_dir() or (any(directory.iterdir()) and not (directory / TRAINER_STATE).is_file())
    ):
        raise SaveError(
            f"--save {directory}: it exists and is not a save (no {TRAINER_STATE}); each save replaces the "
            "directory whole, so give a new or empty directory, or an earlier save"
        )


def check_resume(directory: str | Path, spec: ClusterSpec) -> int:
    """The iteration `directory` was saved after, if this spec can continue from it; `ResumeError`
    naming what does not fit otherwise."""
    d = Path(directory)
    path = d / TRAINER_STATE
    if not path.is_file():
        what = "does not exist" if not d.exists() else f"has no {TRAINER_STATE}"
        raise ResumeError(f"--resume {d}: the directory {what}; expected one `bubbletea train --save` wrote")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        saved_it, saved_model = int(state["iteration"]), dict(state["model"])
        saved_pp, saved_ranges = int(state["pp"]), [tuple(r) for r in state["stage_ranges"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"--resume {d}: cannot read {TRAINER_STATE}: {exc!r}") from None
    if state.get("format") != FORMAT:
        raise ResumeError(f"--resume {d}: {TRAINER_STATE} has format {state.get('format')!r}, expected {FORMAT!r}")
    mine = model_identity(spec)
    for key, value in mine.items():
        if key == "config":
            continue
        if saved_model.get(key) != value:
            field = "training.model" if key == "family" else f"model.{key}"
            raise ResumeError(
                f"--resume {d}: a checkpoint of another model: {field} is {value!r} here but "
                f"{saved_model.get(key)!r} in the checkpoint"
            )
    theirs = saved_model.get("config", {})
    for key in sorted(set(mine.get("config", {})) | set(theirs)):
        here, there = mine.get("config", {}).get(key), theirs.get(key)
        if here != there:
            raise ResumeError(
                f"--resume {d}: a checkpoint of another model: training.model's config.json has {key} = {here!r} "
                f"here but {there!r} in the checkpoint"
            )
    if saved_pp != spec.parallelism.pp or saved_ranges != [tuple(r) for r in stage_layer_ranges(spec)]:
        raise ResumeError(
            f"--resume {d}: parallelism.pp / split: the checkpoint's stages hold layers {saved_ranges}, this spec's "
            f"{stage_layer_ranges(spec)}; resume with the same pipeline split"
        )
    missing = [
        stage_file(k, saved_pp) for k in range(saved_pp) if not (d / OPTIMIZER_DIR / stage_file(k, saved_pp)).is_file()
    ]
    if missing:
        raise ResumeError(f"--resume {d}: {OPTIMIZER_DIR}/ lacks {missing}")
    limit = spec.training.iteration_limit
    if limit is not None and saved_it + 1 >= limit:
        raise ResumeError(
            f"--resume {d}: training.iterations is {limit} and the checkpoint already has {saved_it + 1}: "
            "nothing left to train (raise training.iterations to go on)"
        )
    return saved_it


def saved_iteration(directory: str | Path) -> int | None:
    """The iteration a save directory holds, or None if there is none (no directory, no state)."""
    path = Path(directory) / TRAINER_STATE
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["iteration"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{path}: cannot read the saved iteration: {exc!r}") from None


def stage_state(directory: str | Path, stage: int, stages: int) -> bytes:
    """Stage `stage`'s trainer checkpoint bytes from a save."""
    return (Path(directory) / OPTIMIZER_DIR / stage_file(stage, stages)).read_bytes()

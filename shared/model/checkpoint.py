"""Hugging Face checkpoint directories as `CausalLM`s: `load_causal_lm(path)`. Nothing is downloaded.

A directory holds `config.json` (whose `model_type` picks the family: gpt2, llama, mistral,
qwen2), the weights as safetensors (`model.safetensors`, or shards listed by
`model.safetensors.index.json`, or else every `*.safetensors` in it) and, for serving,
`tokenizer.json` (read by `shared.model.tokenizer`, not here). The loader:

1. reads config.json and builds the family's modules on the meta device (the family refuses
   config keys it does not implement, naming them);
2. reads every stored tensor with `safetensors` (`safe_open`, framework "pt"), maps its name to
   the module's (`rename`), transposes GPT-2's Conv1D weights;
3. checks that every expected tensor is there exactly once with its shape and a float dtype, and
   that nothing is left over but known-ignorable tensors (old mask buffers, `rotary_emb.inv_freq`,
   a tied model's `lm_head.weight`);
4. copies them as float32 into fresh memory and assigns them to the module (on the CPU; the
   caller may `.to` it).

Any problem raises `CheckpointError` at once, saying what was found and what is supported.
A *file* checkpoint is the legacy nanoGPT state_dict (`PrefillModel.from_checkpoint`), not this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from shared.config.model_info import SUPPORTED_MODEL_TYPES, CheckpointError, info_from_config, read_config
from shared.model.causal import CausalLM, LoadableLM
from shared.model.families.gpt2 import GPT2
from shared.model.families.llama import Llama
from shared.model.gpt import StageModule

#: The family module of each supported `model_type`.
FAMILIES: dict[str, type[LoadableLM]] = {"gpt2": GPT2, "llama": Llama, "mistral": Llama, "qwen2": Llama}
assert tuple(FAMILIES) == SUPPORTED_MODEL_TYPES
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Weight files of other formats, named in the error when a directory has no safetensors.
OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack")


def load_causal_lm(path: str | Path) -> CausalLM:
    """The model of a Hugging Face checkpoint directory, float32, in eval mode, frozen, on the CPU."""
    directory = Path(path)
    config = read_config(directory)  # a missing directory or config.json fails here
    info = info_from_config(config)  # an unsupported model_type fails here
    lm = FAMILIES[config["model_type"]].from_config(config, info)
    state = checked_state(lm, read_tensors(directory), directory)
    lm.load_state_dict(state, strict=True, assign=True)
    lm.eval().requires_grad_(False)
    return lm


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory; `CheckpointError` if there are none."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read the shard index {index}: {exc!r}") from exc
        files = [directory / n for n in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are not in {directory}: {absent}")
        return files
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for pattern in OTHER_WEIGHTS for p in directory.glob(pattern))
        raise CheckpointError(
            f"checkpoint directory {directory} has no safetensors weights ({SINGLE_FILE}, or shards with "
            f"{INDEX_FILE}); found other weight files {other}: only safetensors are read"
            if other
            else f"checkpoint directory {directory} has no weights: expected {SINGLE_FILE} or shards with {INDEX_FILE}"
        )
    return files


def read_tensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of the directory's safetensors files, by stored name (each name once)."""
    tensors: dict[str, Tensor] = {}
    where: dict[str, str] = {}
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    if name in tensors:
                        raise CheckpointError(f"tensor {name} is stored twice: in {where[name]} and {file.name}")
                    tensors[name] = f.get_tensor(name)
                    where[name] = file.name
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read weights {file}: {exc}") from exc
    return tensors


def checked_state(lm: LoadableLM, stored: dict[str, Tensor], directory: Path) -> dict[str, Tensor]:
    """The module's state_dict from the stored tensors; `CheckpointError` naming every problem."""
    expected = {name: tuple(t.shape) for name, t in lm.state_dict().items()}  # meta tensors: shapes only
    state: dict[str, Tensor] = {}
    seen: set[str] = set()
    unexpected: list[str] = []
    problems: list[str] = []
    for stored_name, tensor in stored.items():
        name = lm.rename(stored_name)
        if name is None:
            continue  # known-ignorable
        if name not in expected:
            unexpected.append(stored_name)
            continue
        if name in seen:
            problems.append(f"{stored_name} is a second copy of {lm.checkpoint_name(name)}")
            continue
        seen.add(name)
        want = expected[name][::-1] if lm.transposed(name) else expected[name]
        if not tensor.is_floating_point():
            problems.append(f"{stored_name} is {tensor.dtype}, not a float tensor")
        elif tuple(tensor.shape) != want:
            problems.append(f"{stored_name} has shape {tuple(tensor.shape)}, expected {want}")
        else:
            tensor = tensor.t() if lm.transposed(name) else tensor
            state[name] = _fresh_float32(tensor)
    missing = [lm.checkpoint_name(n) for n in expected if n not in seen]
    if missing:
        problems.insert(0, f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {sorted(unexpected)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not fit its config.json ({lm.info.family}, {lm.info.layers} layers, "
            f"d_model {lm.info.d_model}, vocab {lm.info.vocab}): " + "; ".join(problems)
        )
    return state


def _fresh_float32(tensor: Tensor) -> Tensor:
    """A float32 copy in freshly allocated, contiguous memory.

    Always a copy: safetensors hands out views into the file's buffer at whatever offset the file
    put them, and CPU matrix kernels may round differently for differently aligned operands. A
    fresh allocation (aligned by torch's allocator) makes the results independent of how the
    checkpoint was sharded, so two workers loading the same weights compute bit-identical prefills.
    """
    fresh = torch.empty(tensor.shape, dtype=torch.float32)
    fresh.copy_(tensor)
    return fresh


def check_state_dict(module: StageModule, loaded: Mapping[str, object]) -> None:
    """A nanoGPT's `state_dict` against its model: `CheckpointError` naming every missing,
    unexpected, non-tensor or reshaped entry."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    for name, want in expected.items():
        got = loaded.get(name)
        if name in loaded and not (isinstance(got, Tensor) and got.is_floating_point()):
            problems.append(f"{name} is {type(got).__name__}, not a float tensor")
        elif isinstance(got, Tensor) and got.shape != want.shape:
            problems.append(f"{name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if problems:
        raise CheckpointError(f"state_dict does not fit the model {module.cfg}: " + "; ".join(problems))

"""A small GPT for pipeline-parallel training on CPU: the model and its stages (`gpt`), the
byte-level data (`data`), the single-process reference trainer (`reference`) and resumable
prefill inference (`prefill`)."""

from shared.model.data import ByteCorpus, decode, encode
from shared.model.gpt import (
    Block,
    GPTConfig,
    StageModule,
    build_full,
    build_stage,
    lm_loss,
    make_optimizer,
    split_layers,
)
from shared.model.prefill import (
    CheckpointError,
    PrefillModel,
    PrefillResult,
    PrefillState,
    estimate_kv_bytes,
    kv_bytes,
    save_checkpoint,
)
from shared.model.reference import train_reference

__all__ = [
    "Block",
    "ByteCorpus",
    "CheckpointError",
    "GPTConfig",
    "PrefillModel",
    "PrefillResult",
    "PrefillState",
    "StageModule",
    "build_full",
    "build_stage",
    "decode",
    "encode",
    "estimate_kv_bytes",
    "kv_bytes",
    "lm_loss",
    "make_optimizer",
    "save_checkpoint",
    "split_layers",
    "train_reference",
]

"""A small GPT for pipeline-parallel training on CPU: the model and its stages (`gpt`), the
byte-level data (`data`) and the single-process reference trainer (`reference`)."""

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
from shared.model.reference import train_reference

__all__ = [
    "Block",
    "ByteCorpus",
    "GPTConfig",
    "StageModule",
    "build_full",
    "build_stage",
    "decode",
    "encode",
    "lm_loss",
    "make_optimizer",
    "split_layers",
    "train_reference",
]

"""A model's chat template: chat messages to the prompt text it was trained on, without transformers.

Hugging Face stores a model's chat template beside its tokenizer: a ``chat_template.jinja`` file
(which takes priority, as in transformers) or the ``chat_template`` of ``tokenizer_config.json``
(a string, or a list of named templates of which ``default`` is used). The template is Jinja, run
here as transformers runs it (`transformers.utils.chat_template_utils`): a sandboxed, immutable
environment (`jinja2.sandbox.ImmutableSandboxedEnvironment`: chat templates are code from the
model's authors), ``trim_blocks`` and ``lstrip_blocks``, the loop controls, a ``tojson`` that does
not escape HTML, ``raise_exception``, ``strftime_now``, and a ``{% generation %}`` block rendered as
its body. It sees ``messages``, ``add_generation_prompt=True`` (the text ends where the assistant's
answer starts) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) from
``tokenizer_config.json`` (else ``special_tokens_map.json``).

`chat_template_for(prefill_spec)` is the served model's template, or None when it has none (a
nanoGPT, or a directory whose tokenizer files hold none). The rendered text is tokenized without
adding special tokens (the template writes them), as ``apply_chat_template`` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.config.model_info import CheckpointError, read_json_object
from shared.config.spec import Prefill
from shared.model.shape import is_checkpoint_dir

#: The file a single template is saved in by transformers (it takes priority over the config's).
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
#: The special tokens a template may read, as transformers passes them (`special_tokens_map`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template refused them (`raise_exception`) or failed on them."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's tokens with it;
    rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str  # the file it was read from
    template: jinja2.Template
    special_tokens: dict[str, str]

    @classmethod
    def compile(cls, text: str, special_tokens: dict[str, str] | None = None, source: str = "<text>") -> ChatTemplate:
        """`CheckpointError` if `text` is not a valid template."""
        try:
            template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(
                f"the chat template in {source} is not valid Jinja: {exc} (line {exc.lineno})"
            ) from None
        return cls(source, template, dict(special_tokens or {}))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` (role/content dicts). `ChatTemplateError` when the template
        raises (its own check, e.g. roles that must alternate) or fails on them."""
        try:
            return self.template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None


def _token(value: Any) -> str | None:
    """A special token as the config stores it: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_text(directory: Path, config: dict[str, Any]) -> tuple[str, str] | None:
    """(the template, where it was read) of a directory, or None."""
    file = directory / TEMPLATE_FILE
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8"), str(file)
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from None
    where = str(directory / TOKENIZER_CONFIG)
    found = config.get("chat_template")
    if found is None:
        return None
    if isinstance(found, str):
        return found, where
    if isinstance(found, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"]), f"{where} (the template named 'default')"
        raise CheckpointError(
            f"{where} has chat templates named {sorted(map(str, named))} but none named 'default' to serve"
        )
    raise CheckpointError(f"{where}: 'chat_template' must be a string or a list of named templates")


def load_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model directory, or None if its tokenizer files hold
    none. `CheckpointError` for a template that cannot be read or compiled."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG
    config = read_json_object(config_path) if config_path.is_file() else {}
    found = _template_text(directory, config)
    if found is None:
        return None
    text, source = found
    specials_map_path = directory / SPECIAL_TOKENS_MAP
    specials_map = read_json_object(specials_map_path) if specials_map_path.is_file() else {}
    special: dict[str, str] = {}
    for name in SPECIAL_TOKENS:
        token = _token(config.get(name))
        token = token if token is not None else _token(specials_map.get(name))
        if token is not None:
            special[name] = token
    return ChatTemplate.compile(text, special, source)


def chat_template_for(spec: Prefill) -> ChatTemplate | None:
    """The served model's chat template: a checkpoint directory's, else None (nanoGPT has none)."""
    if not is_checkpoint_dir(spec):
        return None
    assert spec.checkpoint is not None
    return load_chat_template(spec.checkpoint)

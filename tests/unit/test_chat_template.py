"""Chat templates rendered as transformers renders them, from the files Hugging Face stores them in.

`shared.model.chat_template` is held to transformers' own `apply_chat_template` (a test-only
dependency) on templates in the styles real models ship: ChatML (Qwen2), Llama 2's (``bos_token``,
``raise_exception``), and one leaning on the environment's settings (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``tojson`` without HTML escapes, ``{% generation %}``). The
token ids are the same as well: the rendered text is tokenized without the special tokens the
tokenizer's post-processor would add (the template writes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import processors
from transformers import PreTrainedTokenizerFast

from shared.config.model_info import CheckpointError
from shared.config.spec import Prefill
from shared.model.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
    load_chat_template,
)
from shared.model.tokenizer import HFTokenizer
from tests.unit.test_hf_models import byte_bpe_tokenizer

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
BLOCKS = """{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- continue %}
    {%- endif %}
    {% generation %}{{ message.role | upper }}: {{ message.content | tojson }}{% endgeneration %}

{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:
{% endif %}
"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "blocks": BLOCKS}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "the quick brown fox <b>&</b> é"},
    {"role": "assistant", "content": " jumps over "},
    {"role": "user", "content": "the lazy dog?"},
]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE whose post-processor adds BOS, as Llama's does: the template writes it too."""
    tok = byte_bpe_tokenizer()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def transformers_tokenizer(tokenizer_file: Path, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), chat_template=template, **SPECIAL)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_text_and_the_token_ids_are_transformers(name: str, tokenizer_file: Path) -> None:
    hf = transformers_tokenizer(tokenizer_file, TEMPLATES[name])
    ours = ChatTemplate.compile(TEMPLATES[name], SPECIAL)
    for messages in (MESSAGES, MESSAGES[1:2]):
        want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = ours.render(messages)
        assert text == want
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert HFTokenizer(tokenizer_file).encode(text, add_special_tokens=False) == list(ids)
    assert HFTokenizer(tokenizer_file).encode("x")[0] == 0  # the post-processor adds BOS to plain text


def test_the_templates_own_check_is_a_chat_template_error_with_its_message() -> None:
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        ChatTemplate.compile(LLAMA2, SPECIAL).render([{"role": "user", "content": "a"}] * 2)


@pytest.mark.parametrize(
    "attack",
    [
        "{{ messages.__class__.__mro__ }}",  # reaching Python's internals
        "{% set _ = messages.append({'role': 'x'}) %}",  # changing the caller's data (immutable sandbox)
        "{{ ''.__class__.__subclasses__() }}",
    ],
)
def test_a_template_runs_sandboxed(attack: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError):
        ChatTemplate.compile(attack).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def write(directory: Path, **files: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = directory / name.replace("__", ".")
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


def test_tokenizer_config_holds_the_template_and_the_special_tokens(tmp_path: Path) -> None:
    d = write(
        tmp_path / "m",
        tokenizer_config__json={
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            "bos_token": {"content": "<s>", "__type": "AddedToken"},  # the older AddedToken form
            "eos_token": "</s>",
        },
    )
    t = load_chat_template(d)
    assert t is not None and t.render([{"role": "user", "content": "hi"}]) == "<s>hi</s>"
    assert t.source == str(d / "tokenizer_config.json")


def test_chat_template_jinja_takes_priority_and_special_tokens_map_fills_in(tmp_path: Path) -> None:
    d = write(
        tmp_path / "m",
        tokenizer_config__json={"chat_template": "from the config"},
        chat_template__jinja="{{ bos_token }}file",
        special_tokens_map__json={"bos_token": "<|begin|>"},
    )
    t = load_chat_template(d)
    assert t is not None and t.render([]) == "<|begin|>file" and t.source.endswith("chat_template.jinja")


def test_named_templates_serve_the_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    t = load_chat_template(write(tmp_path / "a", tokenizer_config__json={"chat_template": named}))
    assert t is not None and t.render([]) == "plain"
    with pytest.raises(CheckpointError, match="none named 'default'"):
        load_chat_template(write(tmp_path / "b", tokenizer_config__json={"chat_template": named[:1]}))


def test_no_template_is_none_and_a_broken_one_is_named(tmp_path: Path) -> None:
    assert load_chat_template(write(tmp_path / "a", tokenizer_config__json={"eos_token": "</s>"})) is None
    assert load_chat_template(write(tmp_path / "b")) is None  # no tokenizer_config.json at all
    assert chat_template_for(Prefill()) is None  # nanoGPT: bytes, no template
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja is not valid Jinja"):
        load_chat_template(write(tmp_path / "c", chat_template__jinja="{% for m in messages %}"))
    with pytest.raises(CheckpointError, match="cannot read"):
        load_chat_template(write(tmp_path / "d", tokenizer_config__json="{not json"))

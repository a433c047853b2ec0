"""Prompt formatting: ``format_prompt(tokenizer, question, cfg.data)`` turns a question (or a conversation, TRL's
conversational format) into the prompt text.

The tokenizer's chat template is rendered with a generation prompt; what a template does with system messages
(whether it accepts them, and which default system prompt it inserts by itself) is probed once per template with
sentinel messages and cached, so that ``data.system_prompt: ""`` really means no system text. A tokenizer
without a chat template gets "Question: ...\\nAnswer:".
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

_CHATML_SYSTEM = "<|im_start|>system\n{}<|im_end|>\n"
_SENT_SYS, _SENT_USER = "BASISLITE-SYSTEM-SENTINEL", "BASISLITE-USER-SENTINEL"


@dataclass(frozen=True)
class _TemplateInfo:
    supports_system: bool
    default_system: str | None  # the text the template inserts when no system message is given
    strip_block: str | None  # the rendered default system turn, removed from prompts (ChatML templates)


_template_cache: dict[tuple, _TemplateInfo] = {}


def _render(tokenizer, messages: list[dict]) -> str:
    out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return out if isinstance(out, str) else str(out)


def _template_info(tokenizer) -> _TemplateInfo:
    key = (tokenizer.chat_template, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None))
    if key in _template_cache:
        return _template_cache[key]
    r0 = _render(tokenizer, [{"role": "user", "content": _SENT_USER}])
    try:
        rs = _render(tokenizer, [{"role": "system", "content": _SENT_SYS}, {"role": "user", "content": _SENT_USER}])
        supports = _SENT_SYS in rs
    except Exception:
        supports, rs = False, ""
    default = strip = None
    if supports:
        pre, post = rs.split(_SENT_SYS, 1)
        if r0.startswith(pre) and r0.endswith(post) and len(r0) > len(pre) + len(post):
            default = r0[len(pre):len(r0) - len(post)]
            block = _CHATML_SYSTEM.format(default)
            if block in r0 and _SENT_USER in r0.replace(block, "", 1):
                strip = block
            else:
                log.warning("the chat template inserts a default system prompt (%r) and is not ChatML; an empty "
                            "system message is passed instead", default[:80])
    info = _TemplateInfo(supports, default, strip)
    _template_cache[key] = info
    return info


def _conversation(question, instruction: str) -> list[dict]:
    """The messages of one prompt: a question becomes one user message; a conversation (TRL's conversational
    format) is copied. data.instruction goes at the end of the (last) user message."""
    if isinstance(question, str):
        convo = [{"role": "user", "content": question.strip()}]
    else:
        convo = [{"role": str(m["role"]), "content": str(m["content"])} for m in question]
    if instruction:
        last = max(i for i, m in enumerate(convo) if m["role"] == "user")
        convo[last]["content"] = convo[last]["content"].strip() + " " + instruction
    return convo


def format_prompt(tokenizer, question, cfg) -> str:
    """The prompt text for one question (a string) or conversation (a list of {"role", "content"} messages, TRL's
    conversational format): the tokenizer's chat template with a generation prompt.

    The (last) user message gets data.instruction appended. A conversation that brings its own system message is
    rendered as it is. Otherwise data.system_prompt becomes a system message only when non-empty. With an empty
    system prompt no system text appears at all: a default system prompt that the template inserts by itself
    (SmolLM2, Qwen2.5) is removed for ChatML templates (or replaced by an empty system message for others). A
    template that rejects the system role gets the system prompt prepended to the first user message. Without a
    chat template: "Question: ...\\nAnswer:" (the messages' contents joined by blank lines)."""
    convo = _conversation(question, (cfg.instruction or "").strip())
    system = (cfg.system_prompt or "").strip()
    if not getattr(tokenizer, "chat_template", None):
        if convo[0]["role"] == "system":
            system, convo = convo[0]["content"].strip(), convo[1:]
        head = f"{system}\n\n" if system else ""
        return f"{head}Question: " + "\n\n".join(m["content"] for m in convo) + "\nAnswer:"
    if convo[0]["role"] == "system":
        return _render(tokenizer, convo)
    info = _template_info(tokenizer)
    if system:
        if info.supports_system:
            return _render(tokenizer, [{"role": "system", "content": system}, *convo])
        first = next(i for i, m in enumerate(convo) if m["role"] == "user")
        convo[first] = {"role": "user", "content": f"{system}\n\n{convo[first]['content']}"}
        return _render(tokenizer, convo)
    if info.default_system is None:
        return _render(tokenizer, convo)
    if info.strip_block is not None:
        return _render(tokenizer, convo).replace(info.strip_block, "", 1)
    return _render(tokenizer, [{"role": "system", "content": ""}, *convo])


def _jinja_str(text: str) -> str:
    """`text` as a Jinja string literal (Python escapes; non-ASCII kept as is, Jinja decodes the escapes back)."""
    return json.dumps(text, ensure_ascii=False)


def training_chat_template(tokenizer, cfg) -> str:
    """A chat template that renders exactly the prompt training used, for exports to ship as their chat template.

    For a conversation of one user message whose content is the question plus data.instruction,
    `apply_chat_template(..., add_generation_prompt=True)` with this template gives `format_prompt(tokenizer,
    question, cfg)` byte for byte: the configured system prompt is put in when the conversation has none, a default
    system turn the base template inserts by itself is removed when training had none (ChatML; other templates get
    an empty system message, as in training), a template without a system role gets the system prompt in front of
    the first user message, and a tokenizer without a chat template gets the "Question: ...\\nAnswer:" form. A
    conversation that brings its own system message is rendered by the base template unchanged. The base template
    is included verbatim; only a wrapper around it is added.
    """
    system = (cfg.system_prompt or "").strip()
    base = getattr(tokenizer, "chat_template", None)
    no_system = "not (messages and messages[0]['role'] == 'system')"
    if not base:
        head = "{{ " + _jinja_str(system + "\n\n") + " }}" if system else ""
        return ("{%- for message in messages if message['role'] == 'user' %}" + head
                + "{{ 'Question: ' + message['content'] + '\\nAnswer:' }}{%- endfor %}")
    info = _template_info(tokenizer)
    if system:
        if info.supports_system:
            return ("{% if " + no_system + " %}{% set messages = [{'role': 'system', 'content': "
                    + _jinja_str(system) + "}] + messages %}{% endif %}" + base)
        return ("{% if messages and messages[0]['role'] == 'user' %}{% set messages = [{'role': 'user', 'content': "
                + _jinja_str(system + "\n\n") + " + messages[0]['content']}] + messages[1:] %}{% endif %}" + base)
    if info.default_system is None:
        return base
    if info.strip_block is not None:
        return ("{% set rendered %}" + base + "{% endset %}{% if " + no_system + " %}{{ rendered | replace("
                + _jinja_str(info.strip_block) + ", '', 1) }}{% else %}{{ rendered }}{% endif %}")
    return ("{% if " + no_system + " %}{% set messages = [{'role': 'system', 'content': ''}] + messages %}{% endif %}"
            + base)

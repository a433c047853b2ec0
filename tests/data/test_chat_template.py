"""Exports ship the chat template training used: `training_chat_template` renders, for one user message, exactly
the prompt `format_prompt` gave in training (byte for byte), for every kind of template `format_prompt` handles:
ChatML without a default system turn (builtin:tiny-random), ChatML that inserts one (SmolLM2, Qwen2.5), a template
that inserts one and is not ChatML, one that rejects the system role, and none at all; with and without a system
prompt, including one full of Jinja syntax, quotes, backslashes and non-ASCII text."""
from __future__ import annotations

import pytest

from basis_lite.config import load_config
from basis_lite.data import format_prompt
from basis_lite.data.prompts import training_chat_template
from basis_lite.model.loading import CHATML_TEMPLATE, build_tiny_tokenizer

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
           "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
           "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + "
          "'<|im_end|>\\n' }}\n{%- else %}\n    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You "
          "are a helpful assistant.<|im_end|>\\n' }}\n{%- endif %}\n{%- for message in messages %}\n    {%- if not "
          "(message.role == 'system' and loop.first) %}\n        {{- '<|im_start|>' + message.role + '\\n' + "
          "message.content + '<|im_end|>' + '\\n' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt "
          "%}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n")
NOT_CHATML = ("{% if messages[0]['role'] != 'system' %}[SYS]Be kind.[/SYS]{% else %}[SYS]{{ messages[0]['content'] }}"
              "[/SYS]{% endif %}{% for m in messages if m['role'] != 'system' %}[INST] {{ m['content'] }} [/INST]"
              "{% endfor %}")
NO_SYSTEM_ROLE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                  "supported') }}{% endif %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TEMPLATES = {"chatml": CHATML_TEMPLATE, "smollm2": SMOLLM2, "qwen2.5": QWEN25, "not-chatml": NOT_CHATML,
             "no-system-role": NO_SYSTEM_ROLE, "none": None}
SYSTEMS = ["", "You are terse.", 'Say "hi" {{ 1 + 1 }} {% raw %} \\n \\ \'q\' é ✓ 😀\nsecond line']
QUESTIONS = ["What is $17 + 25$?", "Tom has 3 apples. Tom gets 5 more apples. How many apples does Tom have now?"]


def _tok(template):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def _render(tok, template, messages):
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("system", range(len(SYSTEMS)))
def test_training_template_reproduces_the_training_prompt_byte_for_byte(name, system):
    cfg = load_config("smoke")
    cfg.data.system_prompt = SYSTEMS[system]
    tok = _tok(TEMPLATES[name])
    template = training_chat_template(tok, cfg.data)
    for q in QUESTIONS:
        trained = format_prompt(tok, q, cfg.data)
        user = q + " " + cfg.data.instruction
        assert _render(tok, template, [{"role": "user", "content": user}]) == trained
        if system and name in ("chatml", "smollm2", "qwen2.5"):
            assert SYSTEMS[system] in trained
    if name not in ("none", "no-system-role"):  # a conversation's own system message: the base template, unchanged
        msgs = [{"role": "system", "content": "Own system."}, {"role": "user", "content": "Hi"}]
        assert _render(tok, template, msgs) == _render(tok, TEMPLATES[name], msgs)


def test_default_system_turn_is_really_gone_and_a_wrong_template_would_fail():
    """The base SmolLM2 template puts its default system turn back (what the exports did before); the training
    template does not, and the training prompt has none."""
    cfg = load_config("smoke")
    tok = _tok(SMOLLM2)
    msgs = [{"role": "user", "content": "What is 1 + 1? " + cfg.data.instruction}]
    trained = format_prompt(tok, "What is 1 + 1?", cfg.data)
    assert "SmolLM" not in trained
    assert _render(tok, SMOLLM2, msgs) != trained
    assert _render(tok, training_chat_template(tok, cfg.data), msgs) == trained

"""Incremental token-in/token-out rendering: prefix-preserving templates, templates that
rewrite history (Qwen3-style), and templates that cannot be extended at all."""

from __future__ import annotations

import pytest

from environments.inference.chat_template import ChatRenderer, ChatTemplateError
from lachesis.tiny_model import CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE, build_tokenizer

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "math",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
HISTORY = [{"role": "user", "content": "What is 2 + 3?"},
           {"role": "assistant", "content": "<think>easy</think>" + CALL}]
RESULT = [{"role": "tool", "name": "calculator", "content": "5"}]
EXPECTED = ("<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")


def renderer_with(template: str) -> ChatRenderer:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    return ChatRenderer(tokenizer)


def test_prefix_preserving_template_appends_only_the_new_messages():
    renderer = renderer_with(CHAT_TEMPLATE)
    assert renderer.after_eos == "\n"
    # The model sampled the assistant turn up to and including <|im_end|>.
    sampled = renderer.encode(HISTORY[-1]["content"] + "<|im_end|>")
    prompt = renderer.prompt_ids(HISTORY[:-1], TOOLS)
    step = renderer.continuation(HISTORY, RESULT, TOOLS, ended_with_eos=True)
    assert step.prefix_preserving and step.text == "\n" + EXPECTED
    assert renderer.decode(prompt + sampled + step.token_ids) == renderer.render(
        HISTORY + RESULT, TOOLS, add_generation_prompt=True)
    # A turn that ended on a stop string gets the end-of-turn token as context.
    step = renderer.continuation(HISTORY, RESULT, TOOLS, ended_with_eos=False)
    assert step.text == "<|im_end|>\n" + EXPECTED


def test_template_that_rewrites_history_keeps_what_the_model_saw():
    # Qwen3-style: <think> blocks are dropped from every assistant turn but the last.
    renderer = renderer_with(THINKING_CHAT_TEMPLATE)
    full = renderer.render(HISTORY + RESULT, TOOLS)
    assert "<think>" not in full  # so render(history) is not a prefix of it
    step = renderer.continuation(HISTORY, RESULT, TOOLS, ended_with_eos=True)
    assert not step.prefix_preserving
    # History stays as sampled (think block included); only the new message is rendered.
    assert step.text == "\n" + EXPECTED


def test_template_whose_rendering_of_new_messages_depends_on_history_is_refused():
    # A marker after whatever message comes last: no rendering is ever a prefix of the next.
    marked = CHAT_TEMPLATE.replace(
        "{%- if add_generation_prompt %}",
        "{%- if not add_generation_prompt %}[end of chat]{%- endif %}"
        "{%- if add_generation_prompt %}")
    renderer = renderer_with(marked)
    with pytest.raises(ChatTemplateError, match="depending on the conversation"):
        renderer.continuation(HISTORY, RESULT, TOOLS, ended_with_eos=True)


def test_template_without_eos_ended_turns_is_refused():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = ("{%- for m in messages %}{{ m.role }}: {{ m.content }}\n"
                               "{%- endfor %}")
    with pytest.raises(ChatTemplateError, match="eos token"):
        ChatRenderer(tokenizer)

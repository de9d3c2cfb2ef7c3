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


FINGERPRINT = """
import hashlib, json, sys
sys.path.insert(0, {repo!r})
from environments.inference.chat_template import ChatRenderer
from environments.inference.tokenizer import load_tokenizer

def fingerprint(tokenizer):
    renderer = ChatRenderer(tokenizer)
    conversation = {conversation!r}
    text = renderer.render(conversation, {tools!r}, add_generation_prompt=True)
    return [type(tokenizer).__name__, tokenizer.name_or_path, len(tokenizer),
            hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
            sorted(tokenizer.all_special_tokens), tokenizer.chat_template, text,
            renderer.encode(text), sorted(renderer.stop_token_ids), renderer.after_eos]
"""


def test_a_models_tokenizer_loads_as_autotokenizer_gives_it_and_after_the_first_without_torch(
        tmp_path, monkeypatch):
    """An env server, an evaluation, `lachesis env process` compute nothing with torch, yet
    transformers 5's AutoTokenizer imports it (2.5 s of CPU a start). After one load of a
    model directory, the tokenizer loads through the class AutoTokenizer chose: the same
    tokenizer (vocabulary, special tokens, template, rendering and its ids, stop ids), in a
    process that never imports torch. A changed tokenizer config is loaded afresh."""
    import json
    import subprocess
    import sys

    from conftest import REPO
    from transformers import AutoTokenizer, GenerationConfig

    from environments.inference.tokenizer import generation_eos_ids, load_tokenizer
    from lachesis.tiny_model import FAMILIES, make_tiny_model

    monkeypatch.setenv("LACHESIS_TOKENIZER_CLASSES", str(tmp_path / "classes"))
    dirs = [make_tiny_model(tmp_path / family, family=family, tied=True)
            for family in FAMILIES]
    dirs.append(make_tiny_model(tmp_path / "arithmetic", tokenizer="arithmetic"))
    code = FINGERPRINT.format(repo=str(REPO), conversation=HISTORY + RESULT, tools=TOOLS)
    namespace: dict = {}
    exec(code, namespace)
    expected = [namespace["fingerprint"](AutoTokenizer.from_pretrained(str(d))) for d in dirs]
    for d in dirs:  # the model's stop ids, read without GenerationConfig (torch)
        eos = GenerationConfig.from_pretrained(d).eos_token_id
        assert generation_eos_ids(str(d)) == ([eos] if isinstance(eos, int) else eos)
    for d, fingerprint in zip(dirs, expected):  # the first load of each: AutoTokenizer's, recorded
        assert namespace["fingerprint"](load_tokenizer(d)) == fingerprint
    assert len(list((tmp_path / "classes").glob("*.json"))) == len(dirs)
    later = code + "print(json.dumps([fingerprint(load_tokenizer(d)) for d in sys.argv[1:]]))" \
        "\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", later, *map(str, dirs)], text=True,
                            capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    fingerprints, torch_imported = result.stdout.strip().splitlines()
    assert json.loads(fingerprints) == json.loads(json.dumps(expected))
    assert torch_imported == "False"
    # the tokenizer config changes: its class is decided again
    config = dirs[0] / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 77}))
    assert load_tokenizer(dirs[0]).model_max_length == 77
    assert len(list((tmp_path / "classes").glob("*.json"))) == len(dirs) + 1

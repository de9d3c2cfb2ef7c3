"""A tiny, randomly initialised chat model built locally (no model-hub downloads).

`make_tiny_model(out_dir)` writes a Hugging Face model directory that both
`transformers` and vLLM (CPU) load:

- a byte-level tokenizer (the 256 byte symbols, no merges) with ChatML special tokens
  `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) and the NON-special added
  tokens `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>` (so
  `decode(..., skip_special_tokens=True)` keeps the tool-call tags). Token id == byte
  value for ids 0..255. Like every `model_type: qwen2` tokenizer under transformers 5.x
  (AutoTokenizer forces `Qwen2Tokenizer`), encoding NFC-normalizes: decode(encode(t)) ==
  unicodedata.normalize("NFC", t), i.e. any NFC text round-trips exactly;
- a prefix-preserving ChatML chat template with Qwen2.5/Hermes-style tool calling;
- a seeded random model of one of three architecture families (``family``): Qwen2
  (``Qwen2ForCausalLM``, the default), Qwen3 (``Qwen3ForCausalLM``: q/k norms, explicit
  head_dim) or Llama (``LlamaForCausalLM``, with a Llama-3-style tokenizer and template:
  ``<|begin_of_text|>``, ``<|start_header_id|>role<|end_header_id|>``, ``<|eot_id|>``);
  float32, head_dim 64, the output embedding tied to the input one on request (``tied``;
  Qwen2.5 0.5B-3B, Qwen3 0.6B-4B and Llama-3.2 tie theirs). The default stays untied, as
  the quickstart's model was built.
- ``template="thinking"``: ChatML whose re-rendering drops the ``<think>...</think>``
  reasoning of every assistant turn that is not the conversation's last message, as
  Qwen3's and QwQ's templates do (the default for ``family="qwen3"``). It is not
  prefix-preserving: see ``reasoning_history`` in docs/environments.md.

Heavy imports (torch, transformers, tokenizers) happen inside the functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

# ChatML with Qwen2.5/Hermes-style tools. Prefix-preserving: every message renders as its
# own block that depends only on itself (and, for the system block, on `tools` and
# messages[0]), so rendering messages[:k] is a prefix of rendering messages[:k+n]. Each
# `tool` message gets its own `user` block (Qwen2.5 merges consecutive tool messages into
# one block, which breaks the prefix property).
CHAT_TEMPLATE = (
    "{%- if tools and messages | length > 0 %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' and messages[0].content %}"
    "{{- messages[0].content + '\\n\\n' }}"
    "{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}"
    "{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is not none else '' %}"
    "{%- if message.role == 'system' and loop.first and tools %}"
    "{#- already rendered inside the tools system block #}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- if message.tool_calls and '<tool_call>' not in content %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' }}{{- tool_call.name | tojson }}{{- ', \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# The same ChatML template with a compact tools block: one line per tool, its name, its
# parameters and the first line of its description, instead of the JSON schemas and the
# paragraph of instructions above (~860 byte tokens for arithmetic_tool). The tiny task
# model reads its whole prompt in ~60 tokens, which is what makes copying learnable on a
# CPU. Tool calls and results render exactly as above (Hermes style).
_TOOLS_BLOCK = CHAT_TEMPLATE[CHAT_TEMPLATE.index("{{- '# Tools"):
                             CHAT_TEMPLATE.index("{%- endif %}{%- for message")]
COMPACT_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(_TOOLS_BLOCK, (
    "{{- 'Tools:' }}"
    "{%- for tool in tools %}"
    "{%- set f = tool.function if tool.function is defined else tool %}"
    "{{- '\\n' + f.name + '(' + (f.parameters.properties | list | join(', ')) + '): ' }}"
    "{{- (f.description or '').split('\\n')[0] }}"
    "{%- endfor %}"
    "{{- '\\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"))


# ChatML that drops earlier turns' reasoning when it re-renders a conversation, as Qwen3's
# template drops the <think> blocks of assistant turns before the last user query (and
# QwQ's, DeepSeek-R1's of every earlier turn): an assistant message keeps its
# <think>...</think> block only when it is the conversation's last message. So rendering
# [.., assistant] shows the reasoning the model sampled, and rendering [.., assistant, tool]
# no longer does: not prefix-preserving.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' + content }}",
    "{%- if not loop.last and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content }}")
assert THINKING_CHAT_TEMPLATE != CHAT_TEMPLATE

# Llama-3 style: a begin-of-text token, role headers, <|eot_id|> ends every turn (the
# eos). Tools render as in the ChatML template (Hermes-style <tool_call> blocks), so
# the same tool parser reads them; each tool result is its own `ipython`-less user block.
BEGIN_OF_TEXT = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
LLAMA_SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, START_HEADER, END_HEADER, EOT)
LLAMA_CHAT_TEMPLATE = (
    CHAT_TEMPLATE
    .replace("{%- if tools and messages | length > 0 %}",
             "{{- bos_token }}{%- if tools and messages | length > 0 %}", 1)
    .replace("'<|im_start|>system\\n'", "'<|start_header_id|>system<|end_header_id|>\\n\\n'")
    .replace("'<|im_start|>user\\n<tool_response>", "'<|start_header_id|>user<|end_header_id|>\\n\\n<tool_response>")
    .replace("'<|im_start|>assistant\\n'", "'<|start_header_id|>assistant<|end_header_id|>\\n\\n'")
    .replace("'<|im_start|>' + message.role + '\\n'", "'<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'")
    .replace("<|im_end|>\\n", EOT)  # Llama-3 puts nothing between a turn and the next header
)
assert "<|im_" not in LLAMA_CHAT_TEMPLATE

FAMILIES = ("qwen2", "qwen3", "llama")
TEMPLATES = ("chatml", "thinking", "compact", "llama")


def build_tokenizer(family: str = "qwen2", template: str | None = None):
    """The byte-level tokenizer of ``family``'s specials, as a
    `transformers.PreTrainedTokenizerFast` with ``template`` (one of :data:`TEMPLATES`;
    None: the family's own, ChatML or Llama-3 style).

    Its pipeline mirrors what `transformers` 5.x rebuilds for any `model_type: qwen2`
    checkpoint (AutoTokenizer forces `Qwen2Tokenizer`, which replaces the normalizer and
    pre-tokenizer of tokenizer.json with NFC + Qwen's split regex + ByteLevel), so the
    saved tokenizer.json, AutoTokenizer and vLLM all tokenize identically. Consequence:
    encode() NFC-normalizes, so decode(encode(text)) == unicodedata.normalize("NFC", text).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte_to_symbol = _bytes_to_unicode()
    assert sorted(byte_to_symbol.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {byte_to_symbol[b]: b for b in range(256)}  # id == byte value for ids 0..255
    tok = _with_qwen_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False)))
    return _chat_tokenizer(tok, _template(family, template), family)


def _template(family: str, template: str | None) -> str:
    if template is None:
        template = {"llama": "llama", "qwen3": "thinking"}.get(family, "chatml")
    if template not in TEMPLATES:
        raise ValueError(f"template: {template!r} is not one of {', '.join(TEMPLATES)}")
    if (template == "llama") != (family == "llama"):
        raise ValueError(f"template {template!r} does not fit family {family!r}: the Llama "
                         "template needs the Llama family's special tokens and vice versa")
    return {"chatml": CHAT_TEMPLATE, "thinking": THINKING_CHAT_TEMPLATE,
            "compact": COMPACT_CHAT_TEMPLATE, "llama": LLAMA_CHAT_TEMPLATE}[template]


def _with_qwen_pipeline(tok):
    """NFC, Qwen's split regex and ByteLevel: what transformers rebuilds for qwen2."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _chat_tokenizer(tok, chat_template: str, family: str = "qwen2"):
    """``tok`` with the family's special tokens and the tool tags added, as a
    `transformers.PreTrainedTokenizerFast` with ``chat_template``: ChatML specials for
    Qwen (eos ``<|im_end|>``), Llama-3's for ``llama`` (bos ``<|begin_of_text|>``, eos
    ``<|eot_id|>``, pad ``<|end_of_text|>``)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    llama = family == "llama"
    specials = LLAMA_SPECIAL_TOKENS if llama else SPECIAL_TOKENS
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOT if llama else IM_END,
        pad_token=END_OF_TEXT if llama else ENDOFTEXT,
        bos_token=BEGIN_OF_TEXT if llama else None,
        unk_token=None,
        extra_special_tokens=[START_HEADER, END_HEADER] if llama else [IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_task_tokenizer(corpus: Iterable[str], vocab_size: int = 512,
                         chat_template: str | None = None):
    """A BPE tokenizer learned on ``corpus`` (text the project generates), as a
    `transformers.PreTrainedTokenizerFast` with ``chat_template`` (default: the compact
    one).

    The same pipeline as :func:`build_tokenizer` (NFC, Qwen's split regex, ByteLevel), so
    transformers, vLLM and this function agree, and every byte is still a token (any text
    encodes): only the merges are learned, up to ``vocab_size``. Qwen's regex isolates
    every digit, so numbers are one token per digit; the ChatML specials and tool tags
    are atomic added tokens, as in the byte tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = _with_qwen_pipeline(Tokenizer(models.BPE(fuse_unk=False)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[])
    # The tags must not be learned as pieces of text: cut them out of the corpus.
    tags = [*SPECIAL_TOKENS, *TOOL_TAGS]
    pieces = (part for text in corpus for part in re.split("|".join(map(re.escape, tags)), text))
    tok.train_from_iterator(pieces, trainer=trainer)
    return _chat_tokenizer(tok, chat_template or COMPACT_CHAT_TEMPLATE)


def file_corpus(paths: Iterable[str | Path]) -> list[str]:
    """The text of ``paths`` (files, or directories read recursively) for a tokenizer to
    learn on: of a JSON file every string in it (captured requests: system prompts, tool
    schemas, messages), of any other file its text."""
    import json

    def strings(value: Any) -> Iterable[str]:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from strings(item)
        elif isinstance(value, list):
            for item in value:
                yield from strings(item)

    texts: list[str] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ValueError(f"tokenizer corpus: {path} does not exist")
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if not file.is_file():
                continue
            text = file.read_text(errors="replace")
            if file.suffix == ".json":
                try:
                    texts += strings(json.loads(text))
                    continue
                except json.JSONDecodeError:
                    pass
            texts.append(text)
    if not texts:
        raise ValueError(f"tokenizer corpus: no text in {', '.join(map(str, paths))}")
    return texts


def arithmetic_corpus(n_conversations: int = 3000, seed: int = 0) -> list[str]:
    """``arithmetic_tool`` demonstrations rendered with the compact template (the text
    the task tokenizer learns its merges on), items drawn with their own seed."""
    import random

    from environments.envs.arithmetic_tool import ArithmeticToolEnv
    from environments.framework.tools import tool_schemas

    env = ArithmeticToolEnv()
    renderer = build_tokenizer()
    renderer.chat_template = COMPACT_CHAT_TEMPLATE
    rng = random.Random(f"corpus-{seed}")
    schemas = tool_schemas(env.tools)
    return [renderer.apply_chat_template(env.oracle_messages(env.make_item(i, rng)),
                                         tools=schemas, tokenize=False)
            for i in range(n_conversations)]


def env_corpus(env: str, settings: dict[str, Any] | None = None, n_conversations: int = 512,
               chat_template: str = CHAT_TEMPLATE) -> list[str]:
    """``n_conversations`` demonstrations of ``env`` (its ``oracle_messages(item)``, items
    from its training pool, in the order ``get_next_item`` gives them), rendered with
    ``chat_template`` and the env's tools: the text a tokenizer for that env learns on
    (``textworld_cooking``: the ε-noisy planner's games, observations and commands)."""
    import asyncio

    from environments.framework.tools import tool_schemas
    from lachesis.env_kinds import load_env_class

    env_class = load_env_class(env)
    if not hasattr(env_class, "oracle_messages"):
        raise ValueError(f"tokenizer corpus: env {env} has no oracle_messages(item) to "
                         "make demonstrations with")
    config = env_class.config_class(**(settings or {}))
    problem = getattr(env_class, "demonstrator_problem", None)
    if problem and (problem := problem(config)):
        raise ValueError(f"tokenizer corpus: env {env} cannot make demonstrations: {problem}")
    instance = env_class(config)

    async def items() -> list[Any]:
        await instance.setup()
        return [await instance.get_next_item() for _ in range(n_conversations)]

    renderer = build_tokenizer()
    renderer.chat_template = chat_template
    schemas = tool_schemas(instance.tools) or None
    return [renderer.apply_chat_template(instance.oracle_messages(item), tools=schemas,
                                         tokenize=False) for item in asyncio.run(items())]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode symbol map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


TOKENIZERS = ("bytes", "arithmetic", "corpus", "env")
"""``bytes``: the byte-level tokenizer and the full Qwen-style template (the test model);
``arithmetic``: BPE merges learned on ``arithmetic_tool`` demonstrations and the compact
template (the quickstart's model: its prompt is ~75 tokens instead of ~940); ``corpus``:
BPE merges learned on the text of ``corpus`` files (e.g. requests captured from agent
harnesses: their prompts are 3-4 times shorter than in bytes) and the family's full
template; ``env``: BPE merges learned on an env's demonstrations (:func:`env_corpus`, e.g.
``textworld_cooking``'s games) and the family's full template."""


def make_tiny_model(out_dir, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2,
                    num_heads: int = 2, num_kv_heads: int = 1,
                    max_position_embeddings: int = 4096,
                    intermediate_size: int | None = None, tokenizer: str = "bytes",
                    vocab_size: int = 512, family: str = "qwen2", tied: bool = False,
                    template: str | None = None,
                    corpus: Iterable[str | Path] | None = None, env: str | None = None,
                    env_settings: dict[str, Any] | None = None,
                    corpus_conversations: int = 512) -> Path:
    """Write tokenizer + chat template + seeded random model to `out_dir`.

    ``tokenizer``: one of :data:`TOKENIZERS`; ``vocab_size``: the learned vocabulary's
    size for ``arithmetic`` (merges stop earlier when the corpus has no more pairs);
    ``family``: one of :data:`FAMILIES`; ``tied``: the output embedding is the input
    one; ``template``: one of :data:`TEMPLATES` (None: the family's own; ``compact`` for
    the ``arithmetic`` tokenizer); ``corpus``: the files the ``corpus`` tokenizer learns
    its merges on (:func:`file_corpus`); ``env``, ``env_settings``, ``corpus_conversations``:
    the env whose demonstrations the ``env`` tokenizer learns on (:func:`env_corpus`)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config
    from transformers import AutoModelForCausalLM

    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer: {tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
    if family not in FAMILIES:
        raise ValueError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    if tokenizer == "arithmetic" and family == "llama":
        raise ValueError("the arithmetic tokenizer has ChatML specials: use family qwen2 "
                         "or qwen3 with it")
    _template(family, template if tokenizer == "bytes" or template != "compact" else None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if (tokenizer == "corpus") != (corpus is not None):
        raise ValueError("tokenizer 'corpus' needs the corpus files, and only it takes them")
    if (tokenizer == "env") != (env is not None):
        raise ValueError("tokenizer 'env' needs the env whose demonstrations it learns on "
                         "(env), and only it takes one")
    if tokenizer == "env" and family == "llama":
        raise ValueError("the env tokenizer has ChatML specials: use family qwen2 or qwen3 "
                         "with it")
    if tokenizer == "bytes":
        tokenizer = build_tokenizer(family, template)
    elif tokenizer == "corpus":
        if family == "llama":
            raise ValueError("the corpus tokenizer has ChatML specials: use family qwen2 or "
                             "qwen3 with it")
        tokenizer = build_task_tokenizer(file_corpus(corpus), vocab_size,
                                         _template(family, template))
    elif tokenizer == "env":
        chat_template = _template(family, template)
        tokenizer = build_task_tokenizer(
            env_corpus(env, env_settings, corpus_conversations, chat_template), vocab_size,
            chat_template)
    else:
        tokenizer = build_task_tokenizer(arithmetic_corpus(seed=seed), vocab_size)
        if template not in (None, "compact"):
            tokenizer.chat_template = _template(family, template)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    pad = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
    bos = tokenizer.convert_tokens_to_ids(tokenizer.bos_token) if tokenizer.bos_token else None

    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tied,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    if family == "qwen2":
        config = Qwen2Config(**shape, use_sliding_window=False)
    elif family == "qwen3":
        config = Qwen3Config(**shape, head_dim=hidden_size // num_heads,
                             use_sliding_window=False)
    else:
        config = LlamaConfig(**shape, head_dim=hidden_size // num_heads)
    config.dtype = "float32"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, bos_token_id=bos)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))

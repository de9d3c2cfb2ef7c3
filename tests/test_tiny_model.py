"""The tiny local model: tokenizer, chat template, seeded weights; VLLMProcess; vLLM I/O."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import unicodedata
import urllib.request

import pytest
from conftest import REPO

from environments.inference.vllm_process import VLLMProcess, VLLMProcessError
from lachesis.tiny_model import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOOL_TAGS,
    build_tokenizer,
    make_tiny_model,
)

TEXTS = [
    "hello world",
    " leading and trailing spaces  ",
    "héllo wörld — naïve café, Ελληνικά, русский, 漢字かな, 한국어, עברית, العربية",
    "emoji 🎉👩‍👩‍👧 and \x00\x01 control \t tabs \r\n crlf \ufeff bom \u200b zwsp",
    'code: def f(x):\n    return {"a": [1, 2.5e-3]}  # ok\n',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (ü).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12*7? Then 3+4."},
    {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "calculator", "arguments": {"expression": "12*7"}}},
        {"id": "b", "type": "function",
         "function": {"name": "calculator", "arguments": '{"expression": "3+4"}'}}]},
    {"role": "tool", "tool_call_id": "a", "content": "84"},
    {"role": "tool", "tool_call_id": "b", "content": "7"},
    {"role": "assistant", "content": ""},
    {"role": "assistant", "content": "",
     "tool_calls": [{"name": "calculator", "arguments": {"expression": "84+7"}}]},
    {"role": "tool", "content": "91"},
    {"role": "user", "content": "Thanks ✓"},
    {"role": "assistant", "content": "84 and 7; 91 in total."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_saved_tokenizer_matches_built_and_raw(tokenizer, tiny_model_dir):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    built = build_tokenizer()
    assert len(tokenizer) == len(built) == 256 + 7
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == built.encode(text, add_special_tokens=False) == raw.encode(text).ids
    assert tokenizer.encode("AZ\n") == [65, 90, 10]  # id == byte


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_round_trip_normalizes_to_nfc(tokenizer):
    decomposed = "cafe\u0301 e\u0301"
    assert tokenizer.decode(tokenizer.encode(decomposed)) == unicodedata.normalize(
        "NFC", decomposed)


def test_special_and_tool_tokens(tokenizer, tiny_model_dir):
    for tag in (ENDOFTEXT, IM_START, IM_END, *TOOL_TAGS):
        ids = tokenizer.encode(f"a{tag}b", add_special_tokens=False)
        assert len(ids) == 3 and ids[1] == tokenizer.convert_tokens_to_ids(tag) >= 256
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == ENDOFTEXT
    assert tokenizer.bos_token is None
    text = f"{IM_START}assistant\n<tool_call>\n{{}}\n</tool_call>{IM_END}{ENDOFTEXT}"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(IM_END),
                                          tokenizer.convert_tokens_to_ids(ENDOFTEXT)]


def render(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, **kwargs)


def test_template_format(tokenizer):
    text = render(tokenizer, CONVERSATION[:5])
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "calculator"' in text
    assert "(ü)" in text  # tojson keeps non-ASCII
    assert "<|im_start|>user\nWhat is 12*7? Then 3+4.<|im_end|>\n" in text
    assert ("<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3+4"}}\n'
            "</tool_call><|im_end|>\n") in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n")
    no_tools = tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False,
                                             add_generation_prompt=True)
    assert no_tools == ("<|im_start|>user\nWhat is 12*7? Then 3+4.<|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_template_keeps_inline_tool_calls_verbatim(tokenizer):
    content = 'ok<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>'
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"name": "calculator", "arguments": {"expression": "1"}}]}
    text = render(tokenizer, [{"role": "user", "content": "x"}, message])
    assert text.endswith(f"<|im_start|>assistant\n{content}<|im_end|>\n")
    assert text.split("<|im_start|>assistant\n")[1].count("<tool_call>") == 1


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_template_is_prefix_preserving(tokenizer, tools):
    messages = CONVERSATION if tools else [m for m in CONVERSATION if m["role"] != "system"]
    texts = [tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False)
             for k in range(1, len(messages) + 1)]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for k in range(len(texts)):
        for j in range(k, len(texts)):
            assert texts[j].startswith(texts[k]), (k, j)
            assert ids[j][:len(ids[k])] == ids[k], (k, j)
    # Generation prompt + the assistant's sampled text + "\n" == next rendering.
    for k, message in enumerate(messages):
        if message["role"] == "assistant" and not message.get("tool_calls"):
            prompt = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False,
                                                   add_generation_prompt=True)
            assert texts[k] == prompt + message["content"] + IM_END + "\n"


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_same_seed_same_weights(tmp_path):
    a = _weights(make_tiny_model(tmp_path / "a", seed=3))
    b = _weights(make_tiny_model(tmp_path / "b", seed=3))
    c = _weights(make_tiny_model(tmp_path / "c", seed=4))
    assert a.keys() == b.keys()
    assert all((a[k] == b[k]).all() for k in a)
    assert any(not (a[k] == c[k]).all() for k in a if a[k].std() > 0)
    assert a["model.embed_tokens.weight"].shape == (263, 128)
    assert a["lm_head.weight"].shape == (263, 128)  # untied by default
    tied = _weights(make_tiny_model(tmp_path / "t", seed=3, tied=True))
    assert "lm_head.weight" not in tied and tied["model.embed_tokens.weight"].shape == (263, 128)


def test_transformers_loads_model(tiny_model_dir, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert model.config.hidden_size // model.config.num_attention_heads == 64 and model.config.num_key_value_heads == 1
    ids = torch.tensor([tokenizer.encode("hi")])
    assert model(ids).logits.shape == (1, 2, len(tokenizer))


def _fake_python(tmp_path, body: str) -> str:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_vllm_process_reports_early_exit(tmp_path):
    proc = VLLMProcess(tmp_path, python=_fake_python(tmp_path, "echo boom: $@; exit 3"),
                       log_path=tmp_path / "log")
    assert proc.command()[1:3] == ["-m", "environments.inference.vllm_serve"]
    assert "--enforce-eager" in proc.command() and proc.url.startswith("http://127.0.0.1:")
    with pytest.raises(VLLMProcessError, match="exited with code 3") as error:
        proc.start().wait_ready(timeout=10)
    assert "boom: -m environments.inference.vllm_serve --model" in str(error.value)
    proc.stop()


def test_vllm_process_timeout_kills_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    proc = VLLMProcess(tmp_path, python=_fake_python(
        tmp_path, f"sleep 120 & echo $! > {pid_file}; echo waiting; wait"),
        log_path=tmp_path / "log")
    proc.start()
    with pytest.raises(VLLMProcessError, match="not healthy after"):
        proc.wait_ready(timeout=1)
    assert not proc.running
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the server's child process survived stop()"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _post(url, body, timeout=300):
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


ENGINE_THREADS = """
import sys
import torch
from environments.inference.vllm_serve import fork_engine_core_on_cpu
from vllm.engine.arg_utils import EngineArgs
fork_engine_core_on_cpu()
config = EngineArgs(model=sys.argv[1], enforce_eager=True, max_model_len=256
                    ).create_engine_config()
print(torch._dynamo.config.disable, config.parallel_config.distributed_executor_backend,
      torch.get_num_threads())
"""


def test_a_cpu_server_leaves_a_core_to_its_scheduler_and_compiles_nothing(tiny_model_dir,
                                                                          monkeypatch):
    """The worker inside the engine core (VLLMProcess's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
    runs torch on every core but one, as vLLM's own worker process would, instead of a
    thread per core whose spinning takes the scheduler's core; with the model eager, vLLM's
    compiled helpers run eagerly (dynamo off) instead of compiling at the first request for
    logprobs. Checked where vLLM's server sets them, its config (the engine core is forked
    from that process after it), in a process without ``OMP_NUM_THREADS`` or
    ``TORCHDYNAMO_DISABLE``; with them, their values stay."""
    import torch
    import torch._dynamo

    from environments.inference.vllm_serve import (leave_a_core_to_the_scheduler,
                                                   run_compiled_helpers_eagerly)

    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "TORCHDYNAMO_DISABLE")}
    done = subprocess.run([sys.executable, "-c", ENGINE_THREADS, str(tiny_model_dir)],
                          env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["True", "uni", str(max(1, (os.cpu_count() or 1) - 1))]
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads + 1))
    leave_a_core_to_the_scheduler()
    assert torch.get_num_threads() == threads
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")  # keeps vLLM's compiled helpers
    assert not run_compiled_helpers_eagerly() and not torch._dynamo.config.disable


def test_vllm_token_in_token_out(vllm_server, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi ✓"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    out = _post(vllm_server.url + "/v1/completions", {
        "model": vllm_server.model_name, "prompt": prompt, "max_tokens": 24, "n": 2,
        "temperature": 1.0, "logprobs": 0, "return_token_ids": True})
    assert len(out["choices"]) == 2
    for choice in out["choices"]:
        assert choice["prompt_token_ids"] == prompt
        ids, logprobs = choice["token_ids"], choice["logprobs"]["token_logprobs"]
        assert 1 <= len(ids) == len(logprobs) <= 24
        assert all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in ids)
        assert all(lp <= 0.0 for lp in logprobs)
        if choice["finish_reason"] == "stop":  # an end-of-turn/text id, possibly the 24th
            assert ids[-1] in {im_end, tokenizer.convert_tokens_to_ids("<|endoftext|>")}
        else:
            assert choice["finish_reason"] == "length" and len(ids) == 24
    # Stopping on <|im_end|>: the eos id is the last token id and has a logprob.
    out = _post(vllm_server.url + "/v1/completions", {
        "model": vllm_server.model_name, "prompt": prompt, "max_tokens": 24, "min_tokens": 3,
        "temperature": 1.0, "logprobs": 0, "return_token_ids": True,
        "logit_bias": {str(im_end): 100}})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == im_end
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 4
    # no line per request in the server's log (VLLMProcess's access_log, off by default)
    log = vllm_server.log_path.read_text()
    assert "Application startup complete" in log and "POST /v1/completions" not in log


@pytest.fixture(scope="module")
def task_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("task") / "arith", tokenizer="arithmetic")


def test_task_tokenizer_learns_the_task_text_and_keeps_digits_and_tags_whole(task_model_dir):
    """The quickstart's tokenizer: merges learned on arithmetic_tool text, every digit one
    token, ChatML specials and tool tags atomic, any text still encodes (byte fallback),
    and the arithmetic_tool prompt with its tool schema in <= 200 tokens."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.envs.arithmetic_tool import ArithmeticToolEnv
    from environments.framework.tools import tool_schemas
    from environments.inference.chat_template import ChatRenderer

    tok = AutoTokenizer.from_pretrained(task_model_dir)
    assert 300 < len(tok) <= 512 + 7
    for tag in (ENDOFTEXT, IM_START, IM_END, *TOOL_TAGS):
        assert len(tok.encode(f"a{tag}b", add_special_tokens=False)) == 3
    digits = tok.encode(" 1234567890", add_special_tokens=False)
    assert [tok.decode([i]) for i in digits] == [" ", *"1234567890"]
    assert len(tok.encode(" calculator", add_special_tokens=False)) == 1  # a learned merge
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == \
            unicodedata.normalize("NFC", text)

    env = ArithmeticToolEnv()
    item = asyncio.run(env.get_next_item())
    renderer = ChatRenderer(tok)
    prompt = renderer.prompt_ids(env.prompt_messages(item), tool_schemas(env.tools))
    assert len(prompt) <= 200
    text = tok.decode(prompt)
    assert "calculator(expression): Evaluate an integer arithmetic expression." in text
    # prefix-preserving through a whole oracle episode, as the agent loop renders it
    messages = env.oracle_messages(item)
    rendered = [tok.apply_chat_template(messages[:k], tools=tool_schemas(env.tools),
                                        tokenize=False) for k in range(1, len(messages) + 1)]
    assert all(rendered[k + 1].startswith(rendered[k]) for k in range(len(rendered) - 1))
    model = AutoModelForCausalLM.from_pretrained(task_model_dir)
    assert not model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.shape[0] == len(tok)


@pytest.mark.parametrize("family,architecture,eos", [
    ("qwen2", "Qwen2ForCausalLM", "<|im_end|>"), ("qwen3", "Qwen3ForCausalLM", "<|im_end|>"),
    ("llama", "LlamaForCausalLM", "<|eot_id|>")])
def test_families_build_tied_on_request_with_their_template(family, architecture, eos,
                                                            tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from environments.inference.chat_template import ChatRenderer

    path = make_tiny_model(tmp_path / family, family=family, tied=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == architecture and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.get_input_embeddings().weight
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(path))  # usable token-in/token-out
    assert renderer.eos_text == eos
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>so</think>yo"}]
    text = renderer.render(messages)
    assert text.startswith("<|begin_of_text|>") == (family == "llama")
    # the thinking template (Qwen3's default) drops reasoning once a message follows
    later = renderer.render(messages + [{"role": "user", "content": "and?"}])
    assert ("<think>so</think>" in later) == (family != "qwen3") and "<think>so" in text
    with pytest.raises(ValueError, match="does not fit family 'llama'"):
        make_tiny_model(tmp_path / "bad", family="llama", template="thinking")
    assert not (tmp_path / "bad").exists()


def test_a_corpus_tokenizer_learns_on_captured_requests_and_keeps_the_chat_template(tmp_path):
    """``make_tiny_model(tokenizer="corpus")``: merges learned on every string of the JSON
    files given (here Pi's captured requests), the family's full template, shorter
    prompts than byte-level; a missing corpus is refused naming it."""
    import json as _json

    import pytest as _pytest

    from lachesis.tiny_model import build_task_tokenizer, build_tokenizer, file_corpus

    corpus = REPO / "tests" / "fixtures" / "harness_requests" / "pi"
    texts = file_corpus([corpus])
    body = _json.loads(sorted(corpus.glob("*.json"))[0].read_text())["body"]
    assert body["messages"][0]["content"] in texts  # the system prompt, as text
    plain = build_tokenizer("qwen2")
    learned = build_task_tokenizer(texts, 1024, plain.chat_template)
    messages = [{"role": "system", "content": body["messages"][0]["content"]},
                {"role": "user", "content": "Write 42 to answer.txt."}]
    short = learned.apply_chat_template(messages, tools=body["tools"], tokenize=False)
    assert short == plain.apply_chat_template(messages, tools=body["tools"], tokenize=False)
    n_learned = len(learned.encode(short, add_special_tokens=False))
    n_bytes = len(plain.encode(short, add_special_tokens=False))
    assert n_learned * 2 < n_bytes, (n_learned, n_bytes)
    assert learned.decode(learned.encode(short, add_special_tokens=False)) == short
    with _pytest.raises(ValueError, match="does not exist"):
        file_corpus([tmp_path / "nothing"])

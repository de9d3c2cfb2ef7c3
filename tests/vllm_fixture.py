"""Session fixtures: the tiny local model, and one real vLLM (CPU) server serving it.

Re-export from tests/conftest.py with

    from vllm_fixture import session_servers, tiny_model_dir, vllm_server  # noqa: F401

(tests/ is not a package; pytest puts tests/ on sys.path, which is how the tests already
`from conftest import ...`.) `tiny_model_dir` is a tied Qwen2. `vllm_server` yields the running `VLLMProcess`: `.url`,
`.model_dir`, `.model_name`, `.log_path`. It starts once per session (~40 s on 2 cores,
plus ~20 s for the first request) and is skipped when vllm is not installed;
`transfer_vllm_server`, when the session's tests use it too, starts beside it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

TINY_MODEL_NAME = "tiny"
VLLM_FIXTURES = {"vllm_server", "transfer_vllm_server"}
"""The session's vLLM servers: a test that uses one (directly or through another fixture)
is marked ``vllm`` (tests/conftest.py), so ``-m unit`` never starts one."""
VLLM_MAX_MODEL_LEN = 4096


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tests' model: tiny Qwen2 with tied embeddings, as Qwen2.5 0.5B-3B have them (so
    every weight-sync test covers the tied output head)."""
    from environments.inference.tokenizer import record_tokenizer_class
    from lachesis.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("models") / TINY_MODEL_NAME, seed=0,
                            tied=True)
    record_tokenizer_class(model)  # as `lachesis run` does: env processes load it without torch
    return model


def _server_specs(model_dir, log_dir) -> dict:
    """The session's servers of the tests' model, by fixture name (none started)."""
    from environments.inference.vllm_process import VLLMProcess
    from trainer.lora import LoraSettings
    from trainer.lora import vllm_options as lora_options
    from trainer.vllm_transfer import vllm_options as transfer_options

    lora_args, lora_env = lora_options(LoraSettings(rank=8))
    transfer_args, transfer_env = transfer_options("shm")
    return {
        "vllm_server": VLLMProcess(
            model_dir, served_model_name=TINY_MODEL_NAME, max_model_len=VLLM_MAX_MODEL_LEN,
            dev_mode=True,
            extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
            log_path=log_dir / "server.log"),
        # hot-loads LoRA adapters and takes in-memory weight transfers (the shm backend)
        "transfer_vllm_server": VLLMProcess(
            model_dir, served_model_name=TINY_MODEL_NAME, max_model_len=1024, dev_mode=True,
            extra_args=[*lora_args, *transfer_args], env={**lora_env, **transfer_env},
            log_path=log_dir / "transfer-server.log"),
    }


class SessionServers:
    """Each of the session's servers starts once, when the first test needs one of them,
    together with every other one the session's selected tests use: their start-ups
    overlap (2 cores: most of a start-up is one busy core)."""

    def __init__(self, specs: dict, needed: set[str]):
        self.specs = specs
        self.needed = needed
        self.failed: dict[str, BaseException] = {}

    def get(self, name: str):
        for other in sorted(self.needed | {name}):
            self.specs[other].start()  # (no-op when running)
        if name in self.failed:
            raise self.failed[name]
        try:
            return self.specs[name].wait_ready(
                timeout=float(os.environ.get("LACHESIS_VLLM_START_TIMEOUT", "300")))
        except BaseException as error:
            self.failed[name] = error  # not started again by every later test
            raise

    def stop(self) -> None:
        for server in self.specs.values():
            server.stop()


@pytest.fixture(scope="session")
def session_servers(tiny_model_dir, tmp_path_factory, request):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    needed = {name for item in request.session.items for name in VLLM_FIXTURES
              if name in getattr(item, "fixturenames", ())}
    servers = SessionServers(_server_specs(tiny_model_dir, tmp_path_factory.mktemp("vllm")),
                             needed)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def vllm_server(session_servers):
    return session_servers.get("vllm_server")


@pytest.fixture(scope="session")
def transfer_vllm_server(session_servers):
    """A second server of the tests' model that also hot-loads LoRA adapters and takes
    in-memory weight transfers (the shm backend), served as ``tiny`` (test_weight_sync.py,
    test_gpu_suite.py)."""
    return session_servers.get("transfer_vllm_server")


async def reload_original(server) -> None:
    """Give ``server`` its model's original weights back, in place (a test that synced
    trained weights into the session's server ends with this). The reload goes through
    the trainer's own checkpoint writer: an in-place reload needs the tied
    ``lm_head.weight`` in the checkpoint, which a plain ``save_pretrained`` leaves out
    (environments/inference/tied_weights.py, ``write_tied_weights``)."""
    import aiohttp
    from transformers import AutoModelForCausalLM

    from trainer.vllm_sync import VLLMWeightSync

    sync = VLLMWeightSync([server.url], server.model_dir.parent / f"{server.model_dir.name}-sync")
    path = sync.weights_dir / "v000000"
    if not path.exists():
        sync.save(AutoModelForCausalLM.from_pretrained(server.model_dir), None, 0)
    await sync.reload(path)
    # the label the server started with: its tokens carry the version an env knows again
    async with aiohttp.ClientSession() as session:
        await sync.label(session, server.url, "default")


def restore_weights(server) -> None:
    """:func:`reload_original`, from synchronous code."""
    import asyncio

    asyncio.run(reload_original(server))

"""A vLLM server owned by the trainer: started as a subprocess, health-checked after every
step, restarted if it died.

The server runs with ``VLLM_SERVER_DEV_MODE=1`` so that weights can be reloaded in place
(:mod:`trainer.vllm_sync`). A restarted server loads the latest weights the trainer
synced, not the initial ones, so the policy it serves does not go back in time; it keeps
its port, so envs pointing at it reconnect by themselves (their pool health-checks it).
"""

from __future__ import annotations

import logging
from pathlib import Path

from environments.inference.vllm_process import VLLMProcess
from environments.settings import run_token

log = logging.getLogger(__name__)


class ManagedVLLM:
    def __init__(self, model_dir: str | Path, *, port: int | None = None,
                 max_model_len: int = 4096, extra_args: list[str] | None = None,
                 log_dir: str | Path = "runs/train", served_model_name: str | None = None,
                 start_timeout_s: float = 300.0, env: dict[str, str] | None = None):
        self.model_dir = Path(model_dir)
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args or [])
        self.env = dict(env or {})
        self.log_dir = Path(log_dir)
        self.served_model_name = served_model_name
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.process = self._process(self.model_dir, port)

    def _process(self, model_dir: Path, port: int | None) -> VLLMProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return VLLMProcess(model_dir, port=port, max_model_len=self.max_model_len,
                           served_model_name=self.served_model_name or self.model_dir.name,
                           dev_mode=True, extra_args=self.extra_args, env=self.env,
                           log_path=self.log_dir / "vllm.log", token=run_token())

    @property
    def url(self) -> str:
        return self.process.url

    def start(self) -> str:
        log.info("starting vLLM for %s on %s", self.model_dir, self.url)
        self.process.start()
        self.process.wait_ready(timeout=self.start_timeout_s)
        return self.url

    def ensure_running(self, latest_weights: Path | None = None, force: bool = False) -> bool:
        """Restart the server if it died or stopped answering (``force``: in any case);
        True if it was restarted."""
        if not force and self.process.running and self.process.healthy(timeout=5.0):
            return False
        log.warning("vLLM at %s is down (exit %s); restarting it with %s", self.url,
                    self.process.proc.poll() if self.process.proc else None,
                    latest_weights or self.model_dir)
        self.process.stop()
        self.process = self._process(latest_weights or self.model_dir, self.process.port)
        self.start()
        self.restarts += 1
        return True

    def stop(self) -> None:
        self.process.stop()

"""The settings of ``lachesis run CONFIG``: one YAML file for the whole system.

Each section is checked against the settings model of the process it configures (the
rollout API's ``APIConfig``, the env's ``config_class``, ``TrainConfig``), so a wrong key
is reported before anything starts. The supervisor fills in what ties the processes
together (ports, URLs, the model the warm start produced, paths under ``runs/NAME/``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from environments.settings import load_settings

# Keys the supervisor sets itself; a config that sets them would be silently overridden.
_WIRED = {
    "api": {"host", "port", "db"},
    "env": {"api_url", "inference_servers", "tokenizer", "jsonl_out", "spool_path",
            "eval_out", "total_groups"},
    "train": {"model", "tokenizer", "mode", "api_url", "data", "vllm_urls", "vllm_launch",
              "run_dir", "resume"},
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class VLLMSettings(_Section):
    port: int | None = Field(default=None, ge=1, le=65535)
    """None: a free port."""
    max_model_len: int = Field(default=4096, ge=16)
    dtype: str = "float32"
    kv_cache_gib: int = Field(default=2, ge=1)
    """KV cache of the CPU build (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    args: list[str] = Field(default_factory=list)
    """Extra arguments for the vLLM server."""
    startup_timeout_s: float = Field(default=600.0, gt=0)


class EnvSettings(_Section):
    name: str
    """Registered env name, ``file.py:Class`` or ``module:Class``."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """Keys of the env's config class."""


class WarmStartSettings(_Section):
    env: str
    """The env whose ``oracle_messages(item)`` gives the demonstrations."""
    demonstrations: int = Field(default=512, ge=1)
    settings: dict[str, Any] = Field(default_factory=dict)
    """Env settings for drawing the demonstration items (difficulty, seed)."""
    train: dict[str, Any] = Field(default_factory=dict)
    """``TrainConfig`` keys for the SFT phase (mode is sft)."""


class RunConfig(_Section):
    name: str
    """The run writes everything under ``runs_dir/name``."""
    runs_dir: Path = Path("runs")
    model: str
    """The policy: an HF model directory or name (the warm start trains from it)."""
    build_tiny_model: bool | dict[str, Any] = False
    """Build ``model`` with ``make-tiny-model`` when the directory does not exist: true, or
    the builder's settings (e.g. ``{tokenizer: arithmetic, num_layers: 2}``, see
    ``lachesis.tiny_model.make_tiny_model``)."""
    warm_start: WarmStartSettings | None = None
    """SFT on env demonstrations before RL (skipped when its result exists)."""
    api: dict[str, Any] = Field(default_factory=dict)
    """``APIConfig`` keys."""
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    envs: list[EnvSettings] = Field(min_length=1)
    """One env server per entry."""
    train: dict[str, Any] = Field(default_factory=dict)
    """``TrainConfig`` keys for the RL phase."""
    lora: dict[str, Any] | None = None
    """Train a LoRA adapter in the RL phase (``TrainConfig.lora``: rank, alpha, dropout,
    target_modules): vLLM starts with runtime adapter loading, each new adapter version is
    hot-loaded and the envs switch to it."""
    evaluate: bool = True
    """Evaluate every env before and after RL (its ``eval_items``, greedy by default)."""
    evaluate_before: bool = True
    """With ``evaluate``: also before RL (off when the starting policy was measured already)."""
    startup_timeout_s: float = Field(default=120.0, gt=0)
    """How long the rollout API and env servers may take to come up."""

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"{name!r}: use letters, digits, '.', '_' and '-' only")
        return name

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def rl_train(self) -> dict[str, Any]:
        """The RL phase's ``TrainConfig`` keys, with the ``lora`` section."""
        return {**self.train, **({"lora": self.lora} if self.lora is not None else {})}

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> RunConfig:
        config = load_settings(cls, path, None, overrides)
        config.check_sections()
        return config

    def check_sections(self) -> None:
        """Validate every section against its process's settings model (raises ValueError
        naming the section and the key)."""
        from environments.api.schemas import APIConfig
        from lachesis.env_kinds import load_env_class
        from trainer.config import TrainConfig

        def check(where: str, kind: str, settings: type[BaseModel], values: dict[str, Any],
                  **fill: Any) -> None:
            wired = sorted(set(values) & _WIRED[kind])
            if wired:
                raise ValueError(f"{where}: {', '.join(wired)} are set by `lachesis run` "
                                 "itself; remove them")
            try:
                settings.model_validate({**fill, **values})
            except ValidationError as error:
                raise ValueError(f"{where}: {error}") from None

        check("api", "api", APIConfig, self.api)
        for i, env in enumerate(self.envs):
            check(f"envs[{i}] ({env.name}).settings", "env",
                  load_env_class(env.name).config_class, env.settings)
        if self.lora is not None and "lora" in self.train:
            raise ValueError("lora: set it at the top level or under train, not both")
        check("train", "train", TrainConfig, self.rl_train, model=self.model)
        batch_size = TrainConfig.model_validate({"model": self.model, **self.rl_train}).batch_size
        for i, env in enumerate(self.envs):
            group_size = load_env_class(env.name).config_class.model_validate(
                env.settings).group_size
            if batch_size % group_size:
                raise ValueError(
                    f"envs[{i}] ({env.name}).settings: group_size {group_size} does not divide "
                    f"train.batch_size {batch_size}; batches hold whole groups, so every "
                    f"batch would have {batch_size - batch_size % group_size} sequences")
        if self.warm_start is not None:
            env_class = load_env_class(self.warm_start.env)
            if not hasattr(env_class, "oracle_messages"):
                raise ValueError(f"warm_start.env: {self.warm_start.env} has no "
                                 "oracle_messages(item) to make demonstrations with")
            check("warm_start.settings", "env", env_class.config_class,
                  self.warm_start.settings)
            check("warm_start.train", "train", TrainConfig, self.warm_start.train,
                  model=self.model)


def write_yaml(path: Path, values: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(_plain(values), sort_keys=False))
    return path


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value

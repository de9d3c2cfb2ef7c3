"""Layered settings, shared by ``lachesis api``, ``lachesis env`` and ``lachesis train``:
CLI flags > YAML file > class defaults."""

from __future__ import annotations

import hmac
import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel

Settings = TypeVar("Settings", bound=BaseModel)


def load_settings(model: type[Settings], path: str | Path | None, section: str | None,
                  overrides: dict[str, Any]) -> Settings:
    """``model``'s defaults < the YAML file at ``path`` (its top level, or its ``section:``
    mapping when it has one) < the ``overrides`` that are not None."""
    values: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        values = dict(loaded.get(section, loaded))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return model.model_validate(values)


# -- the run's token -------------------------------------------------------------------
TOKEN_VARIABLE = "LACHESIS_API_TOKEN"
"""The environment variable holding the run's secret: ``lachesis run`` makes one per run
(or takes the user's from this variable) and hands it to every process it starts, which
send it as ``Authorization: Bearer TOKEN`` to the rollout API, the vLLM servers and the
Atropos bridge; each refuses a request without it (docs/security.md)."""


def run_token() -> str | None:
    """The run's token from the environment (None when unset or empty)."""
    return os.environ.get(TOKEN_VARIABLE) or None


def bearer_headers(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header that carries ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def token_matches(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer TOKEN``, compared in
    constant time."""
    expected = f"Bearer {token}".encode()
    return hmac.compare_digest((authorization or "").encode(), expected)

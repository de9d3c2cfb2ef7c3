"""Layered settings, shared by ``lachesis api``, ``lachesis env`` and ``lachesis train``:
CLI flags > YAML file > class defaults."""

from __future__ import annotations

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

"""A model's tokenizer, exactly as ``AutoTokenizer.from_pretrained`` gives it, without
importing torch where that can be avoided.

transformers 5 finds the tokenizer class through the model's config classes, and that
import chain imports torch (``configuration_utils`` -> ``generation`` -> torch): a load
took 3.5 s of CPU and 488 MB at its peak on this project's 2-core machine, against
1.0-1.3 s and 88 MB without torch (the tiny Qwen2), in processes that compute nothing with
torch (an env server, an evaluation, ``lachesis env process``), which a run starts many
times (every env, both evaluations, every restart). The class AutoTokenizer picks needs
none of it. So the first load of a local model directory goes through AutoTokenizer and
records the class it returned; later loads of the same directory call that class's
``from_pretrained`` as AutoTokenizer itself ends (``_from_auto=True``), and get the same
tokenizer.

The record is keyed by the directory's real path, its file names, the contents of
``config.json`` and ``tokenizer_config.json`` (everything AutoTokenizer chooses the class
by) and the transformers version; it lives in :func:`cache_dir`. A hub name, a class from
outside transformers (remote code) or a record that cannot be used is loaded through
AutoTokenizer, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

CLASS_FILES = ("config.json", "tokenizer_config.json")
"""What AutoTokenizer chooses the class by (with the directory's file names)."""


def cache_dir() -> Path:
    """``$LACHESIS_TOKENIZER_CLASSES``, else ``tokenizer-classes`` in ``$LACHESIS_CACHE``
    (default ``~/.cache/lachesis``)."""
    if os.environ.get("LACHESIS_TOKENIZER_CLASSES"):
        return Path(os.environ["LACHESIS_TOKENIZER_CLASSES"])
    root = os.environ.get("LACHESIS_CACHE") or Path.home() / ".cache" / "lachesis"
    return Path(root) / "tokenizer-classes"


def _record_path(directory: Path) -> Path | None:
    """Where the class recorded for this directory lives; None where nothing is recorded
    (not a local directory, transformers not installed)."""
    if not directory.is_dir():
        return None
    try:
        key = hashlib.sha256(f"transformers {version('transformers')}\n".encode())
    except PackageNotFoundError:
        return None
    key.update(f"{directory.resolve()}\n".encode())
    key.update("\n".join(sorted(p.name for p in directory.iterdir())).encode())
    for name in CLASS_FILES:
        with contextlib.suppress(OSError):
            key.update(f"\n{name}\n".encode() + (directory / name).read_bytes())
    return cache_dir() / f"{key.hexdigest()}.json"


def _recorded_class(record: Path) -> type | None:
    try:
        entry = json.loads(record.read_text())
        return getattr(importlib.import_module(entry["module"]), entry["class"])
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None


def _record(record: Path, cls: type) -> None:
    if not cls.__module__.startswith("transformers."):
        return  # remote code: AutoTokenizer decides every time
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=record.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump({"module": cls.__module__, "class": cls.__qualname__}, out)
        os.replace(tmp, record)


def load_tokenizer(name_or_path: str | os.PathLike) -> Any:
    """``AutoTokenizer.from_pretrained(name_or_path)``, through the recorded class where
    this directory's is known; a packaged model's name loads its checkpoint's
    (:mod:`environments.inference.packaged_models`)."""
    from environments.inference.packaged_models import resolve_model

    name = resolve_model(str(name_or_path))
    return _load(name, _record_path(Path(name)))


def _load(name: str, record: Path | None) -> Any:
    cls = _recorded_class(record) if record is not None and record.exists() else None
    if cls is not None:
        return cls.from_pretrained(name, _from_auto=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if record is not None:
        _record(record, type(tokenizer))
    return tokenizer


def record_tokenizer_class(name_or_path: str | os.PathLike) -> None:
    """Record a local model directory's tokenizer class now, unless it is already: what
    starts several processes that load it at once (``lachesis run`` its env servers and
    evaluations) does, so that none of them imports torch. A tokenizer that does not load
    is left for those processes to report."""
    record = _record_path(Path(str(name_or_path)))
    if record is None or record.exists():
        return
    try:
        _load(str(name_or_path), record)
    except Exception:  # noqa: BLE001 - the processes that need it say what is wrong
        return


def generation_eos_ids(name_or_path: str) -> list[int]:
    """The eos ids of the model's generation config (vLLM stops on these too), when it
    has one: read from ``generation_config.json`` in a local directory (transformers'
    GenerationConfig would import torch), through GenerationConfig otherwise."""
    path = Path(name_or_path) / "generation_config.json"
    if Path(name_or_path).is_dir():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            return []
    else:
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(name_or_path).eos_token_id
        except (OSError, ValueError):
            return []
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

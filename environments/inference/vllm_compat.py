"""Compatibility shims for atroposlib 0.4.0 beside vLLM 0.32 and transformers 5 (stdlib
only, cheap to import).

atroposlib's tool-call translator imports ``ExtractedToolCallInformation``,
``FunctionCall`` and ``ToolCall`` from ``vllm.entrypoints.openai.engine.protocol``; vLLM
0.32 moved them to ``vllm.entrypoints.generate.base.protocol``. atroposlib then warns
"vLLM is not installed — tool call parsing is disabled" and hands every completion back
as plain text, so a tool-using env's episodes end after their first turn.
:func:`install` makes the old module name an alias of the new one (only where the old one
is missing and the new one exists).

atroposlib's ``tokenize_for_trainer`` slices what ``tokenizer.apply_chat_template(chat)``
returns, a list of ids before transformers 5 and a dict since; the item's ``tokens`` are
then no list and atroposlib fails to send the group. :func:`install` also makes it ask
for the list (``return_dict=False``).

``lachesis env serve|process|evaluate`` and ``lachesis run`` install both before they
load an atroposlib env.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any

OLD = "vllm.entrypoints.openai.engine.protocol"
NEW = "vllm.entrypoints.generate.base.protocol"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``OLD`` (and its package) only when vLLM has no such module of its own."""

    def find_spec(self, name, path=None, target=None):
        if name not in (OLD, OLD.rpartition(".")[0]):
            return None
        for finder in sys.meta_path:  # vLLM's own module, if this version has it
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            if finder.find_spec(name, path, target) is not None:
                return None
        if importlib.util.find_spec(NEW) is None:
            return None
        return importlib.util.spec_from_loader(name, self, is_package=name != OLD)

    def create_module(self, spec):
        if spec.name == OLD:
            return importlib.import_module(NEW)
        return None  # the package: an empty module

    def exec_module(self, module):
        if module.__name__ == OLD.rpartition(".")[0]:
            module.__path__ = []


TOKENIZE = "atroposlib.utils.tokenize_for_trainer"


class _ListTemplates:
    """``tokenizer``, whose ``apply_chat_template`` returns token ids as a list (its
    default before transformers 5) unless asked otherwise."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("return_dict", False)
        return self._tokenizer.apply_chat_template(*args, **kwargs)


def _fix_tokenize(module: Any) -> None:
    original = module.tokenize_for_trainer
    if getattr(original, "lachesis_fixed", False):
        return

    @functools.wraps(original)
    def tokenize_for_trainer(tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        return original(_ListTemplates(tokenizer), *args, **kwargs)

    tokenize_for_trainer.lachesis_fixed = True  # type: ignore[attr-defined]
    module.tokenize_for_trainer = tokenize_for_trainer


class _FixOnImport(importlib.abc.MetaPathFinder):
    """Applies :func:`_fix_tokenize` when atroposlib's module is imported."""

    def find_spec(self, name, path=None, target=None):
        if name != TOKENIZE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _fix_tokenize(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Put both shims in place (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
    if TOKENIZE in sys.modules:
        _fix_tokenize(sys.modules[TOKENIZE])
    elif not any(isinstance(f, _FixOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _FixOnImport())

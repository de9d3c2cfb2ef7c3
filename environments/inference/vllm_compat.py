"""A compatibility shim for atroposlib 0.4.0 on vLLM 0.32 (stdlib only, cheap to import).

atroposlib's tool-call translator imports ``ExtractedToolCallInformation``,
``FunctionCall`` and ``ToolCall`` from ``vllm.entrypoints.openai.engine.protocol``; vLLM
0.32 moved them to ``vllm.entrypoints.generate.base.protocol``. atroposlib then warns
"vLLM is not installed — tool call parsing is disabled" and hands every completion back
as plain text, so a tool-using env's episodes end after their first turn.
:func:`install` makes the old module name an alias of the new one (only where the old one
is missing and the new one exists); ``lachesis env serve|process|evaluate`` and
``lachesis run`` install it before they load an atroposlib env.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

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


def install() -> None:
    """Put the alias on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())

"""The package structure stays as drawn: imports go one way, no module import cycles, no
imports of another module's private names.

    data model  <-  rollout API, inference, sandboxes, inspection  <-  env framework
                <-  envs and adapters (other frameworks' envs: env kinds, which the framework
                    finds through its plugin registry, never by import)
    trainer: data model, the rollout API client, inference helpers
    lachesis (front door: CLI, supervisor): anything; nothing imports it
    inspection (reports): imported only by the front door

Every import counts, function-local ones included (they hide cycles, they do not remove
them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("environments", "trainer", "lachesis")

DATA_MODEL = {"environments.trajectory", "environments.rollout", "environments.jsonl_store",
              "environments.settings", "environments.heartbeat"}
LOWER = ("environments.api", "environments.inference", "environments.sandbox",
         "environments.inspection")
TRAINER_MAY_IMPORT = DATA_MODEL | {"environments.api.client", "environments.inference"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if "data" in path.relative_to(REPO / package).parts:  # env fixtures (swe_fix repos)
                continue
            found[module_name(path)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for each import of a project module."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append((alias.name, [], node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[:len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in known:  # `from package import module`
                    found.append((sub, [], node.lineno))
                else:
                    found.append((base, [alias.name], node.lineno))
    return [(m, names, line) for m, names, line in found if m.split(".")[0] in PACKAGES]


def in_(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> int:
    """0 data model, 1 services and helpers, 2 env framework, 3 concrete envs and adapters."""
    if module in DATA_MODEL:
        return 0
    if in_(module, LOWER):
        return 1
    if in_(module, ["environments.envs", "environments.adapters"]):
        return 3
    return 2


def test_imports_go_one_way():
    known = modules()
    wrong = []
    for name, path in sorted(known.items()):
        for target, names, line in imports(name, path, set(known)):
            where = f"{path.relative_to(REPO)}:{line} imports {target}"
            if target.startswith("lachesis") and not name.startswith("lachesis"):
                wrong.append(f"{where}: nothing imports the front door")
            elif name.startswith("environments") and target.startswith("trainer"):
                wrong.append(f"{where}: environments never imports trainer")
            elif name.startswith("trainer") and target.startswith("environments") \
                    and not in_(target, TRAINER_MAY_IMPORT):
                wrong.append(f"{where}: the trainer imports only the data model, the API "
                             "client and inference helpers")
            elif name.startswith("environments") and target.startswith("environments"):
                if in_(target, ["environments.inspection"]) \
                        and not in_(name, ["environments.inspection"]):
                    wrong.append(f"{where}: only the front door writes reports")
                elif target == "environments" and name != "environments":
                    wrong.append(f"{where}: import the module itself, not the package root")
                elif layer(target) > layer(name):
                    wrong.append(f"{where}: layer {layer(name)} imports layer {layer(target)}")
                elif layer(target) == layer(name) == 1 and \
                        name.split(".")[1] != target.split(".")[1]:
                    wrong.append(f"{where}: {name.split('.')[1]} and {target.split('.')[1]} "
                                 "are peers and do not import each other")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_between_modules():
    known = modules()
    graph = {name: {t for t, _, _ in imports(name, path, set(known))
                    if t in known and t != name and not name.startswith(t + ".")}
             for name, path in known.items()}
    # Tarjan's strongly connected components
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_imports_of_other_modules_private_names():
    known = modules()
    wrong = [f"{path.relative_to(REPO)}:{line} takes {n} from {target}"
             for name, path in known.items()
             for target, names, line in imports(name, path, set(known))
             for n in names if n.startswith("_") and target != name]
    assert not wrong, "\n".join(wrong)


def test_processes_that_compute_nothing_start_without_torch():
    """The supervisor of `lachesis run`, the rollout API and an env server compute nothing
    with torch: importing it costs each start about 1.5 s of CPU (a run starts these many
    times: restarts, evaluations, every test of `lachesis run`)."""
    modules = ["lachesis.cli", "lachesis.run.supervisor", "environments.api.routes",
               "environments.framework.runner"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"

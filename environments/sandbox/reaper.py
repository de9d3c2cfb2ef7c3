"""Remove what sandboxes of dead processes left behind.

Every sandbox records its owner, ``PID.STARTTIME`` of the process that made it (the pair
stays unique when pids are reused): bwrap / unsafe workspaces in their directory name,
docker containers and volumes in labels. A sandbox whose owner is gone (a crashed or
killed rollout worker) was never closed: :func:`reap` kills its processes and removes it.
``max_age_s`` also removes those of live owners that are older than that (a worker that
leaks sandboxes). Each backend reaps once per process, at its first sandbox; run it by
hand with ``python -m environments.sandbox reap``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

from environments.sandbox.base import (
    HOST_LABEL,
    LABEL,
    OWNER_LABEL,
    SandboxConfig,
    default_workspace_root,
    owner_alive,
)
from environments.sandbox.host import remove_tree
from environments.sandbox.images import docker_client

log = logging.getLogger(__name__)

_WORKSPACE_NAME = re.compile(r"^\d+\.\d+-[0-9a-f]{12}$")
"""``PID.STARTTIME-SANDBOXID``: what bwrap / unsafe workspaces are named."""


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (bwrap's bind of the workspace)."""
    needle = text.encode()
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if needle in f.read():
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def reap_workspaces(root: Path | None = None, *, max_age_s: float | None = None) -> list[str]:
    """bwrap / unsafe: remove workspaces of dead owners (and older than ``max_age_s``);
    their processes are killed first. Returns the removed directory names."""
    root = Path(root or default_workspace_root())
    if not root.is_dir():
        return []
    removed = []
    now = time.time()
    for entry in os.scandir(root):
        if not _WORKSPACE_NAME.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        owner = entry.name.partition("-")[0]
        old = max_age_s is not None and now - entry.stat().st_mtime > max_age_s
        if owner_alive(owner) and not old:
            continue
        for pid in _processes_mentioning(entry.path):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            remove_tree(Path(entry.path))
            removed.append(entry.name)
        except OSError as error:
            log.warning("could not remove leftover sandbox %s: %s", entry.path, error)
    if removed:
        log.warning("removed %d leftover sandbox workspace(s) in %s", len(removed), root)
    return removed


def reap_docker(*, max_age_s: float | None = None, client=None) -> list[str]:
    """docker: remove containers (and their volumes) of dead owners on this host (and all
    older than ``max_age_s``). Returns the removed container names."""
    import socket

    client = client or docker_client()
    host = socket.gethostname()
    removed = []
    now = time.time()
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        labels = container.labels
        created = float(labels.get("lachesis.created", now))
        old = max_age_s is not None and now - created > max_age_s
        mine = labels.get(HOST_LABEL) == host
        if not old and (not mine or owner_alive(labels.get(OWNER_LABEL, ""))):
            continue
        try:
            container.remove(force=True, v=True)
            removed.append(container.name)
        except Exception as error:  # noqa: BLE001 - already gone, or the daemon refuses
            log.warning("could not remove leftover container %s: %s", container.name, error)
    for volume in client.volumes.list(filters={"label": LABEL}):
        labels = volume.attrs.get("Labels") or {}
        created = float(labels.get("lachesis.created", now))
        old = max_age_s is not None and now - created > max_age_s
        if not old and (labels.get(HOST_LABEL) != host
                        or owner_alive(labels.get(OWNER_LABEL, ""))):
            continue
        try:
            volume.remove(force=True)
        except Exception as error:  # noqa: BLE001 - still in use by a container being removed
            log.debug("could not remove leftover volume %s: %s", volume.name, error)
    if removed:
        log.warning("removed %d leftover sandbox container(s)", len(removed))
    return removed


def reap(backend: str = "all", config: SandboxConfig | None = None, *,
         max_age_s: float | None = None) -> list[str]:
    """Remove leftovers of ``backend`` (``bwrap``, ``unsafe_subprocess``, ``docker`` or
    ``all``)."""
    config = config or SandboxConfig()
    removed: list[str] = []
    if backend in ("bwrap", "unsafe_subprocess", "all"):
        removed += reap_workspaces(config.workspace_root, max_age_s=max_age_s)
    if backend in ("docker", "all"):
        try:
            removed += reap_docker(max_age_s=max_age_s)
        except Exception as error:  # noqa: BLE001
            if backend == "docker":
                raise
            log.info("docker not reaped: %s", error)
    return removed

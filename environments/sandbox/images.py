"""Docker images for sandboxes, built without a registry, and a daemon when none runs.

The default image is a Debian root filesystem made by ``debootstrap --variant=minbase``
from Debian's package archive (the only place images can come from here), with
``python3`` (full standard library) and coreutils, stripped of docs, locales and apt
caches (~120 MB), and imported with ``docker import``. Its tag is a hash of the recipe,
so an existing image is reused (``ensure_image``) and a changed recipe builds a new one.
Building takes about a minute on 2 cores (measured: debootstrap ~45-55 s, import ~5 s).

Per-task images: pass any image to ``SandboxConfig.image``; it needs ``/bin/sh``,
``sleep`` and coreutils' ``timeout`` (the exec wrapper), and what the task runs. Build one
``FROM`` this image with ``docker build`` (no registry needed).

``ensure_dockerd()`` starts ``dockerd`` the way it runs on machines without iptables or a
bridge (``--iptables=false --ip6tables=false --storage-driver=vfs --bridge=none``) when no
daemon answers; the tests and the benchmark use it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from environments.sandbox.base import DEFAULT_IMAGE, MissingSystemPackage, SandboxError

log = logging.getLogger(__name__)

_client_lock = threading.Lock()
_client = None


def docker_client():
    """The process's docker client (``DOCKER_HOST`` or the default socket)."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                import docker
            except ImportError:
                raise SandboxError("the docker backend needs the docker SDK: pip install "
                                   "'lachesis-rl[sandbox]' (or docker)") from None
            try:
                client = docker.from_env(timeout=120)
                client.ping()
            except Exception as error:  # noqa: BLE001 - any failure to reach the daemon
                raise SandboxError(f"cannot reach the docker daemon: {error}") from error
            _client = client
        return _client


RECIPE = {
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3"],
    "strip": ["var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "usr/share/doc",
              "usr/share/man", "usr/share/info", "usr/share/locale", "var/log/*"],
    "changes": ['CMD ["/bin/sh"]', "ENV LANG=C.UTF-8",
                "ENV PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
                "WORKDIR /workspace"],
}
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DOCKERD_ARGS = ["--iptables=false", "--ip6tables=false", "--storage-driver=vfs",
                "--bridge=none"]


def default_image() -> str:
    """``lachesis-sandbox-python:<hash of RECIPE>``."""
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:12]
    return f"{DEFAULT_IMAGE}:{RECIPE['suite']}-{digest}"


def image_exists(tag: str, client=None) -> bool:
    import docker


    try:
        (client or docker_client()).images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def build_rootfs(target: Path, *, mirror: str | None = None, log_file: Path | None = None
                 ) -> None:
    """debootstrap RECIPE into ``target`` (root only), then strip it."""
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        raise MissingSystemPackage("debootstrap", "debootstrap", "it builds the sandbox image")
    if os.geteuid() != 0:
        raise SandboxError("building the sandbox image needs root (debootstrap)")
    mirror = mirror or os.environ.get("LACHESIS_DEBIAN_MIRROR", DEFAULT_MIRROR)
    command = [debootstrap, f"--variant={RECIPE['variant']}",
               f"--include={','.join(RECIPE['include'])}", RECIPE["suite"], str(target), mirror]
    with open(log_file or os.devnull, "ab") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = Path(log_file).read_text()[-2000:] if log_file else ""
        raise SandboxError(f"debootstrap failed (exit {done.returncode}): {tail}")
    for pattern in RECIPE["strip"]:
        for path in target.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def build_image(tag: str | None = None, *, mirror: str | None = None, client=None) -> dict:
    """Build the default image as ``tag`` (default: :func:`default_image`); returns timings."""

    tag = tag or default_image()
    client = client or docker_client()
    repository, _, version = tag.rpartition(":")
    timings = {"image": tag}
    with tempfile.TemporaryDirectory(prefix="lachesis-rootfs-") as work:
        root = Path(work) / "rootfs"
        started = time.monotonic()
        build_rootfs(root, mirror=mirror, log_file=Path(work) / "debootstrap.log")
        timings["debootstrap_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        archive = Path(work) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(archive), "."],
                       check=True)
        client.api.import_image_from_file(str(archive), repository=repository, tag=version,
                                          changes=RECIPE["changes"])
        timings["import_s"] = round(time.monotonic() - started, 1)
        timings["size_mb"] = round(client.images.get(tag).attrs["Size"] / 2**20)
    log.info("built sandbox image %s: %s", tag, timings)
    return timings


def ensure_image(tag: str | None = None, *, build: bool = True, client=None) -> str:
    """The default image's tag, built first if it does not exist (and ``build``)."""
    tag = tag or default_image()
    if not image_exists(tag, client):
        if not build:
            raise SandboxError(f"docker image {tag} does not exist")
        build_image(tag, client=client)
    return tag


def docker_ping() -> bool:
    try:
        import docker

        docker.from_env(timeout=5).ping()
        return True
    except Exception:  # noqa: BLE001 - no SDK, no socket, no daemon
        return False


def ensure_dockerd(*, timeout_s: float = 90.0, log_path: str | Path | None = None,
                   data_root: str | None = None) -> subprocess.Popen | None:
    """Start ``dockerd`` if no daemon answers. Returns the started process (stop it with
    :func:`stop_dockerd`), or None when one was already running."""
    if docker_ping():
        return None
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise MissingSystemPackage("dockerd", "docker.io", "no docker daemon answers")
    if os.geteuid() != 0:
        raise SandboxError("no docker daemon answers; starting dockerd needs root")
    log_path = Path(log_path or Path(tempfile.gettempdir()) / "lachesis-dockerd.log")
    args = [dockerd, *DOCKERD_ARGS]
    if data_root:
        args.append(f"--data-root={data_root}")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SandboxError(f"dockerd exited with {proc.returncode}: "
                               f"{log_path.read_text()[-2000:]}")
        if docker_ping():
            log.info("started dockerd (pid %d), log in %s", proc.pid, log_path)
            return proc
        time.sleep(0.5)
    proc.terminate()
    raise SandboxError(f"dockerd did not answer within {timeout_s:.0f} s; log in {log_path}")


def stop_dockerd(proc: subprocess.Popen | None, timeout_s: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

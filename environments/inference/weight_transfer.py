"""CPU backends for vLLM's weight-transfer API: the trainer's weights go into vLLM's
workers in memory, no checkpoint files.

vLLM 0.32 moves weights from a trainer into running servers through
``vllm.distributed.weight_transfer``: the trainer drives ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` over HTTP
(``HTTPVLLMWeightSyncClient``) and the tensors go through a backend engine that lives in
every vLLM worker (``WeightTransferEngineFactory``) and in the trainer
(``WeightTransferTrainerFactory``). Its backends (``nccl``, ``ipc``, ...) need CUDA; this
module adds two to both factories, with the lifecycle of vLLM's dense NCCL engine
(``start_weight_update`` begins vLLM's layerwise reload, every received tensor goes to
``model.load_weights``, ``finish_weight_update`` finalises the reload):

- ``shm`` (same machine): the trainer copies the weights into one shared-memory file
  (``/dev/shm``) at fixed offsets, then ``/update_weights`` names them (names, dtypes,
  shapes, offsets) and every worker loads them from its mapping of that file;
- ``gloo`` (any machine the trainer can reach): the trainer (rank 0) and the workers
  (ranks ``rank_offset + worker rank``) join a stateless gloo group (vLLM's
  ``stateless_init_torch_distributed_process_group``, a TCPStore rendezvous at
  ``master_address:master_port``); the workers receive the tensors by broadcast, in the
  order ``/update_weights`` names them.

vLLM's processes load this module through the ``vllm.general_plugins`` entry point
``lachesis_weight_transfer`` (``pyproject.toml``; :func:`register` runs in the API
server, the engine core and every worker). :func:`plugin_pythonpath` makes the entry point visible to a vLLM
started from a source tree that is not pip-installed with it.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from environments.heartbeat import beat_in_forked_children, beat_in_thread
from environments.inference.vllm_plugin import (  # noqa: F401  (this module's API too)
    BACKENDS,
    PLUGIN_GROUP,
    PLUGIN_NAME,
    PLUGIN_TARGET,
    plugin_installed,
    plugin_pythonpath,
)


def register() -> None:
    """vLLM plugin entry point: add the ``gloo`` and ``shm`` engines to vLLM's factories
    (idempotent: vLLM may load plugins more than once per process). Under ``lachesis
    run`` the process also beats (:mod:`environments.heartbeat`), and so does every
    process forked from it (the engine core, which vLLM forks on a CPU after this ran):
    a frozen engine core answers nothing while its API server still answers ``/health``."""
    beat = beat_in_thread("vllm API server")
    if beat is not None:
        beat.doing("serving")
    beat_in_forked_children("vllm engine core")
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for backend in BACKENDS:
        prefix = backend.capitalize()
        for factory, cls in ((WeightTransferEngineFactory, f"{prefix}WeightTransferEngine"),
                             (WeightTransferTrainerFactory,
                              f"{prefix}TrainerWeightTransferEngine")):
            if backend not in factory._registry:
                factory.register_engine(backend, __name__, cls)


def _open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float):
    """Join the gloo group; rank 0 (the trainer) hosts its TCPStore, listening on
    ``address`` only (a TCPStore left to bind by itself listens on every interface)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    listen = None
    if rank == 0:
        listen = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((address, port))
        listen.listen()
    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s),
        listen_socket=listen)


def _broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast from group rank 0 (the trainer), on the group object itself: vLLM's
    stateless groups are not registered with torch.distributed's global rank table."""
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


# --------------------------------------------------------------------------------------
# the vLLM worker side
# --------------------------------------------------------------------------------------
try:
    from vllm.distributed.weight_transfer.base import (
        ParamMeta,
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightSource,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError:  # vLLM not installed: nothing here can run, the module still imports
    WeightTransferEngine = TrainerWeightTransferEngine = None  # type: ignore[assignment,misc]


if WeightTransferEngine is not None:
    @dataclass(kw_only=True)
    class GlooWeightTransferInitInfo(WeightTransferInitInfo):
        """The rendezvous of the worker side; the trainer is group rank 0."""

        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        timeout_s: float = 300.0

    @dataclass
    class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
        """The tensors of one update, in the order they are broadcast."""

        names: list[str]
        dtype_names: list[str]
        shapes: list[list[int]]

        def __post_init__(self) -> None:
            if not len(self.names) == len(self.dtype_names) == len(self.shapes):
                raise ValueError(f"names, dtype_names and shapes differ in length: "
                                 f"{len(self.names)}, {len(self.dtype_names)}, "
                                 f"{len(self.shapes)}")

    class _LayerwiseEngine(WeightTransferEngine):
        """The worker-side lifecycle both backends share: vLLM's layerwise reload around
        an update, and a clean session end when an update fails midway."""

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(); the tensors are in
            # place when receive_weights returns, and a CPU has no accelerator.
            try:
                self.receive_weights(self.parse_update_info(update_info))
            except BaseException:
                # A stream cut midway leaves layers on the meta device with wrapped
                # loaders, which a later reload_weights cannot load into: close the
                # layerwise session (layers that got nothing keep their old tensors).
                # The model is still part old, part new: the trainer reloads it whole
                # (from disk) before the server resumes.
                self.finish_weight_update()
                raise

    class GlooWeightTransferEngine(_LayerwiseEngine):
        """Receives the trainer's broadcast in a vLLM worker."""

        init_info_cls = GlooWeightTransferInitInfo
        update_info_cls = GlooWeightTransferUpdateInfo

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group = None

        def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
            self.shutdown()
            parallel = self.parallel_config
            worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
            self.group = _open_group(init_info.master_address, init_info.master_port,
                                     worker_rank + init_info.rank_offset,
                                     init_info.world_size, init_info.timeout_s)

        def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: call "
                                   "/init_weight_transfer_engine first")
            for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                               update_info.shapes):
                weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
                _broadcast(self.group, weight)
                self.model.load_weights([(name, weight.to(self.device))])

        def shutdown(self) -> None:
            if self.group is not None:
                from vllm.distributed.utils import (
                    stateless_destroy_torch_distributed_process_group,
                )

                stateless_destroy_torch_distributed_process_group(self.group)
                self.group = None

    # ----------------------------------------------------------------------------------
    # the trainer side
    # ----------------------------------------------------------------------------------
    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """The trainer's rendezvous: it hosts the TCPStore at ``master_address:
        master_port``; ``world_size`` = 1 + the number of vLLM workers."""

        backend: ClassVar[str] = "gloo"

        master_address: str
        master_port: int
        world_size: int
        timeout_s: float = 300.0

    class StateDictSource(WeightSource):
        """A ``WeightSource`` over a ``{name: tensor}`` mapping (a model's state dict, or
        the full state dict gathered from a sharded model)."""

        def __init__(self, weights: dict[str, torch.Tensor]) -> None:
            self.weights = weights

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights.items()]

        def __iter__(self):
            return iter(self.weights.items())

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        """Drives one vLLM server's update through ``client`` and broadcasts ``source``'s
        tensors to its workers. Single trainer rank (the leader holds the whole model)."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.group = None

        @classmethod
        def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
            if source is None:
                raise ValueError("the gloo trainer engine needs a WeightSource")
            if not init_info.is_sender:
                raise ValueError("the gloo trainer engine runs on trainer rank 0 only")
            engine = cls(client=client, source=source)
            worker = GlooWeightTransferInitInfo(
                master_address=init_info.master_address, master_port=init_info.master_port,
                rank_offset=1, world_size=init_info.world_size, timeout_s=init_info.timeout_s)
            # The workers join the group inside the HTTP call, the trainer beside it. The
            # trainer's side runs in a daemon thread: if the server refuses the handshake,
            # the error comes back at once and that thread is left to time out.
            opened: dict[str, Any] = {}

            def open_group() -> None:
                try:
                    opened["group"] = _open_group(init_info.master_address,
                                                  init_info.master_port, 0,
                                                  init_info.world_size, init_info.timeout_s)
                except BaseException as error:  # noqa: BLE001 - re-raised below
                    opened["error"] = error

            thread = threading.Thread(target=open_group, name="gloo-rendezvous", daemon=True)
            thread.start()
            client.init_weight_transfer_engine(asdict(worker))
            thread.join()
            if "error" in opened:
                raise opened["error"]
            engine.group = opened["group"]
            return engine

        def send_weights(self) -> None:
            meta = self.source.metadata()
            update = GlooWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta])
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:  # the workers receive inside the /update_weights call
                future = pool.submit(self.client.update_weights, asdict(update))
                for (name, tensor), m in zip(self.source, meta, strict=True):
                    if future.done():  # the server gave up: say why instead of hanging
                        future.result()
                    if name != m.name:
                        raise ValueError(f"WeightSource yielded {name!r}, metadata says "
                                         f"{m.name!r}")
                    _broadcast(self.group, tensor.detach().cpu().contiguous())
                future.result()
            finally:
                pool.shutdown(wait=False)
            self.client.finish_weight_update()

        def shutdown(self) -> None:
            if self.group is not None:
                from vllm.distributed.utils import (
                    stateless_destroy_torch_distributed_process_group,
                )

                stateless_destroy_torch_distributed_process_group(self.group)
                self.group = None

    # ----------------------------------------------------------------------------------
    # shared memory: the same machine
    # ----------------------------------------------------------------------------------
    ALIGNMENT = 64

    def shm_layout(meta: list[ParamMeta]) -> tuple[list[int], int]:
        """Byte offsets of the tensors in the shared file (each aligned to 64 bytes, so
        every dtype can be viewed in place) and the file's size."""
        offsets, size = [], 0
        for m in meta:
            offsets.append(size)
            nbytes = m.dtype.itemsize * int(torch.Size(m.shape).numel())
            size += -(-nbytes // ALIGNMENT) * ALIGNMENT
        return offsets, max(size, ALIGNMENT)

    def _map(path: str, size: int) -> torch.Tensor:
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype,
              shape: list[int]) -> torch.Tensor:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        return buffer[offset:offset + nbytes].view(dtype).view(shape)

    def _put(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s bytes into ``buffer`` at ``offset``. A plain memcpy (numpy's),
        not ``Tensor.copy_``: torch splits large copies over its intra-op threads, which
        on a CPU shared with vLLM (and anything else) made them ~5x slower here."""
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        np.copyto(buffer[offset:offset + data.numel()].numpy(), data.numpy())

    @dataclass(kw_only=True)
    class ShmWeightTransferInitInfo(WeightTransferInitInfo):
        """The shared file (on the trainer's and the server's machine) and its size."""

        path: str
        size: int

    @dataclass
    class ShmWeightTransferUpdateInfo(GlooWeightTransferUpdateInfo):
        """The tensors of one update and where each starts in the shared file."""

        offsets: list[int] = field(default_factory=list)

        def __post_init__(self) -> None:
            super().__post_init__()
            if len(self.offsets) != len(self.names):
                raise ValueError(f"{len(self.offsets)} offsets for {len(self.names)} tensors")

    class ShmWeightTransferEngine(_LayerwiseEngine):
        """Loads the weights a trainer on the same machine put in a shared file."""

        init_info_cls = ShmWeightTransferInitInfo
        update_info_cls = ShmWeightTransferUpdateInfo

        def __init__(self, config, vllm_config, device, model) -> None:
            super().__init__(config, vllm_config, device, model)
            self.buffer: torch.Tensor | None = None

        def init_transfer_engine(self, init_info: ShmWeightTransferInitInfo) -> None:
            if not Path(init_info.path).is_file():
                raise FileNotFoundError(f"shm weight transfer: no file {init_info.path} here "
                                        "(the trainer must run on this machine; use gloo)")
            self.buffer = _map(init_info.path, init_info.size)

        def receive_weights(self, update_info: ShmWeightTransferUpdateInfo) -> None:
            if self.buffer is None:
                raise RuntimeError("shm weight transfer not initialised: call "
                                   "/init_weight_transfer_engine first")
            # One load_weights call for all of them (it builds its name tables per call).
            self.model.load_weights(
                (name, _view(self.buffer, offset, getattr(torch, dtype_name), shape)
                 .to(self.device))
                for name, dtype_name, shape, offset in zip(
                    update_info.names, update_info.dtype_names, update_info.shapes,
                    update_info.offsets))

        def shutdown(self) -> None:
            self.buffer = None

    @dataclass
    class ShmTrainerInitInfo(TrainerInitInfo):
        """Where the trainer creates the shared file (a tmpfs: ``/dev/shm``)."""

        backend: ClassVar[str] = "shm"

        directory: str = "/dev/shm"

    class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
        """Copies ``source``'s tensors into the shared file, then has the server load
        them. The file is sized once, at the handshake, for the source's tensors."""

        init_info_cls = ShmTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.path: str | None = None
            self.buffer: torch.Tensor | None = None
            self.layout: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
            self.offsets: list[int] = []

        @classmethod
        def trainer_init(cls, init_info: ShmTrainerInitInfo, *, client, source=None):
            if source is None:
                raise ValueError("the shm trainer engine needs a WeightSource")
            engine = cls(client=client, source=source)
            meta = source.metadata()
            engine.layout = [(m.name, m.dtype, tuple(m.shape)) for m in meta]
            engine.offsets, size = shm_layout(meta)
            fd, engine.path = tempfile.mkstemp(prefix="lachesis-weights-",
                                               dir=init_info.directory)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            try:
                engine.buffer = _map(engine.path, size)
                client.init_weight_transfer_engine(
                    asdict(ShmWeightTransferInitInfo(path=engine.path, size=size)))
            finally:
                # Both sides have mapped it: its memory lives as long as a mapping does,
                # so a crash on either side leaves nothing behind in /dev/shm.
                Path(engine.path).unlink(missing_ok=True)
            return engine

        def send_weights(self) -> None:
            meta = self.source.metadata()
            if [(m.name, m.dtype, tuple(m.shape)) for m in meta] != self.layout:
                raise ValueError("the weights' names, dtypes or shapes changed since the "
                                 "handshake: the shared file no longer fits them")
            for (name, tensor), m, offset in zip(self.source, meta, self.offsets,
                                                 strict=True):
                _put(self.buffer, offset, tensor)
            update = ShmWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta], offsets=self.offsets)
            self.client.start_weight_update()
            self.client.update_weights(asdict(update))
            self.client.finish_weight_update()

        def shutdown(self) -> None:
            self.buffer = None

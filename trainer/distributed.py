"""Data parallelism: joining the process group, FSDP2 sharding, and whole (unsharded)
state dicts for checkpoints and weight sync."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import TrainConfig


def init_distributed() -> tuple[int, int]:
    """``(rank, world_size)``; joins the process group when started by ``torchrun`` (or
    with its variables, one process per rank: ``lachesis run --ray``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store = rendezvous_store(world)
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            **({"store": store, "rank": int(os.environ["RANK"]), "world_size": world}
               if store is not None else {}))
    return (dist.get_rank() if world > 1 else 0), world


def leave_process_group(*, together: bool) -> None:
    """Leave the process group before the interpreter exits (no-op outside one).

    Exiting without ``destroy_process_group`` leaves gloo's worker threads to be torn down
    while the interpreter finalizes, which can abort the process (SIGABRT, "terminate
    called without an active exception": pytorch/pytorch#190489), so a rank that finished
    its steps could fail a run that succeeded. ``together``: a normal end, reached by every
    rank; wait for the others first (rank 0 may still be writing the last checkpoint).
    A rank that raised leaves at once (waiting could hang on a dead peer)."""
    if not dist.is_initialized():
        return
    try:
        if together:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def rendezvous_store(world: int) -> dist.TCPStore | None:
    """Without torchrun (whose agent hosts the store), rank 0 hosts the rendezvous store
    itself, listening on ``MASTER_ADDR`` only (torch's ``env://`` store listens on every
    interface of the machine), and the other ranks join it. None under torchrun."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or "MASTER_ADDR" not in os.environ:
        return None
    from torch.distributed.constants import default_pg_timeout

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if int(os.environ["RANK"]) != 0:
        return dist.TCPStore(address, port, world, is_master=False, timeout=default_pg_timeout)
    listen = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listen.bind((address, port))
    listen.listen()
    return dist.TCPStore(address, port, world, is_master=True, timeout=default_pg_timeout,
                         wait_for_workers=False, master_listen_fd=listen.detach())


def use_deterministic_kernels() -> None:
    """Deterministic kernels only, from here on: ``torch.use_deterministic_algorithms``
    (an op without a deterministic kernel raises, naming itself) and the cuBLAS workspace
    setting that makes its matmuls repeat. Call it before the first CUDA matmul: cuBLAS
    reads ``CUBLAS_WORKSPACE_CONFIG`` when it starts."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def uses_fsdp(config: TrainConfig, world: int) -> bool:
    if world == 1:
        return False
    if config.sharding == "auto":
        return torch.cuda.is_available()
    return config.sharding == "fsdp"


def shard_model(model: torch.nn.Module) -> None:
    """FSDP2: shard every transformer block (HF ``_no_split_modules``), then the root.

    FSDP averages gradients over ranks; ``train_step`` scales its losses by the world size
    to turn that back into the sum its weighting needs. (A divide factor of 1 would say it
    directly, but gloo has no PREMUL_SUM reduction.)"""
    from torch.distributed.fsdp import fully_shard

    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no transformer block class "
                         "(_no_split_modules): cannot shard it with FSDP")
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


def full_state_dict(model: torch.nn.Module, sharded: bool) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU. Sharded: a collective every rank must call; rank 0
    gets the weights, the others an empty dict."""
    if not sharded:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model, optimizer, sharded: bool) -> dict[str, Any]:
    """The optimizer state, unsharded (a collective when sharded, as above)."""
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, optimizer, state: dict[str, Any], sharded: bool) -> None:
    if not sharded:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def broadcast_object(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (picklable objects; the others pass None)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

"""How much memory a trainer step takes: ``memory/*`` metrics in metrics.jsonl (and
TensorBoard / wandb through the same sink), this rank's process:

- ``memory/peak_gib``: the step's peak: on a GPU the most torch allocated during it
  (``torch.cuda.max_memory_allocated``, reset at the step's start); on a CPU the process's
  peak resident set during it (the kernel's high-water mark ``VmHWM``, reset at the step's
  start through ``/proc/self/clear_refs``; Linux);
- ``memory/held_gib``: what the process holds at the step's end: torch's reserved memory
  on a GPU (its caching allocator's), the resident set on a CPU.

A ``held_gib`` that climbs from step to step while ``peak_gib`` stays flat is memory
the allocator keeps, not memory the step needs.
"""

from __future__ import annotations

import ctypes
import os
import resource

import torch

GIB = 2**30


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_kib_field(path: str, key: str) -> int | None:
    """The bytes of a ``key: N kB`` line of a /proc file (``/proc/self/status``'s
    ``VmHWM``, ``/proc/meminfo``'s ``MemAvailable``); None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set since its start or :func:`reset_peak_rss`."""
    peak = proc_kib_field("/proc/self/status", "VmHWM")
    return peak if peak is not None else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak(device: torch.device) -> None:
    """Start measuring a peak (a step's, the rehearsal's) from now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def peak_gib(device: torch.device) -> float:
    """The peak since :func:`reset_peak`."""
    return (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else peak_rss_bytes()) / GIB


def step_memory(device: torch.device) -> dict[str, float]:
    """The ``memory/*`` metrics of the step since :func:`reset_peak`."""
    held = torch.cuda.memory_reserved(device) if device.type == "cuda" else rss_bytes()
    return {"memory/peak_gib": peak_gib(device), "memory/held_gib": held / GIB}


def release_freed_memory() -> bool:
    """Give the pages glibc's malloc holds free back to the kernel (``malloc_trim(0)``:
    the top of each heap and, since glibc 2.8, free pages inside it). A CPU trainer's
    tensors of changing shapes leave freed gaps that glibc keeps, so without this its
    resident set climbs from step to step (docs/memory.md has it measured). False where
    there is no glibc (musl, macOS)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False

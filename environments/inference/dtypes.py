"""``dtype: auto``: bfloat16 where the hardware computes it natively, float32 elsewhere.

On a CPU, bfloat16 pays only with native instructions: AMX-BF16 (``amx_bf16``) or
AVX512-BF16 (``avx512_bf16``) in ``/proc/cpuinfo``'s flags; without them PyTorch and
vLLM emulate it and it is slower than float32 (docs/packaged-models.md has the figures of
both kinds of machine). On a GPU, bfloat16 where CUDA supports it.
"""

from __future__ import annotations

from pathlib import Path

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """Which of :data:`BF16_CPU_FLAGS` this CPU has ([] where /proc/cpuinfo is unreadable)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return [flag for flag in BF16_CPU_FLAGS if flag in flags]


def resolve_dtype(dtype: str, *, gpu: bool = False) -> str:
    """``auto`` becomes ``bfloat16`` or ``float32`` for this machine (``gpu``: for its
    CUDA device); any other value is returned as it is."""
    if dtype != "auto":
        return dtype
    if gpu:
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() \
            else "float32"
    return "bfloat16" if cpu_bf16_flags() else "float32"

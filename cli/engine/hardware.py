"""What the machine offers: physical cores, AMX, GPU offload."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


def physical_cores() -> int:
    # llama-cpp-python's Llama decodes on half the logical CPUs (one thread on a 2-core VM, half
    # the speed), llama.cpp's C default is a fixed 4; SMT siblings only contend for the same
    # units, so quill uses one thread per physical core.
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def _cpuinfo(key: str, cpuinfo: Path) -> str | None:
    """The value of key's first line in cpuinfo (None: no such line, or no file)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    return next((line.partition(":")[2].strip() for line in lines if line.startswith(key)), None)


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    return set((_cpuinfo("flags", cpuinfo) or "").split())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    return _cpuinfo("model name", cpuinfo) or platform.machine()


def cpu_has_amx(flags: set[str] | None = None) -> bool:
    """Intel AMX (Sapphire Rapids and newer Xeons), where ggml's AMX matmul crashes (llama.cpp
    issue 20824): models load without the extra buffer types there."""
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in AMX_FLAGS)

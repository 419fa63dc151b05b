"""What the machine offers: physical cores, AMX, GPU offload."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


def physical_cores() -> int:
    # llama.cpp's own defaults count logical CPUs; on SMT machines and small VMs that
    # oversubscribes the cores and decode slows down, so quill counts physical ones.
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.machine()


def cpu_has_amx(flags: set[str] | None = None) -> bool:
    """True on CPUs with Intel AMX (Sapphire Rapids and newer Xeons).

    ggml's AMX matmul kernels crash there (llama.cpp issue 20824), so quill loads models
    without the extra (repacked) buffer types on such CPUs.
    """
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in AMX_FLAGS)

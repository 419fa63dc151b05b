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

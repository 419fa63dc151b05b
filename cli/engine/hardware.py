"""What the machine offers: physical cores, AMX, GPUs and their free memory."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
GGML_DEVICE_CPU = 0  # ggml_backend_dev_type values
GGML_DEVICE_GPU = 1  # a GPU with memory of its own
GGML_DEVICE_IGPU = 2  # one sharing the host's memory
ANY_GPU = (GGML_DEVICE_GPU, GGML_DEVICE_IGPU)


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


def gpu_memory(types: tuple[int, ...] | None = None) -> list[tuple[str, int]]:
    """(description, free bytes) of each device of these types (default: GPUs with memory of
    their own) in llama.cpp's device list, read from ggml's library alone: in 0.1 s, where
    importing llama-cpp-python takes 0.5. An RPC build's servers are not listed before a
    command attaches them (cli/engine/rpc.py)."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    found = sorted(Path(spec.origin).parent.glob("lib/*ggml.*")) if spec and spec.origin else []
    try:
        ggml = ctypes.CDLL(str(found[0]))
    except (IndexError, OSError):
        return []
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_description.restype = ctypes.c_char_p
    gpus = []
    for index in range(ggml.ggml_backend_dev_count()):
        device = ctypes.c_void_p(ggml.ggml_backend_dev_get(ctypes.c_size_t(index)))
        if ggml.ggml_backend_dev_type(device) in (types or (GGML_DEVICE_GPU,)):
            free, total = ctypes.c_size_t(), ctypes.c_size_t()
            ggml.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
            gpus.append((ggml.ggml_backend_dev_description(device).decode(), free.value))
    return gpus

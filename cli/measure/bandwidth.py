"""The physical limit of decode: how many bytes a step reads, and how fast this machine's memory
can deliver them. The bandwidth is measured once per CPU model and thread count and kept in
QUILL_HOME/bandwidth.json (delete the file to measure again); a measurement taken while other
processes were busy is not kept (one beside another benchmark read 34.5 GB/s here, quiet 44-48)."""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from cli.engine.freecores import BUSY_SHARE, measure_free_cores, restart_window
from cli.engine.hardware import cpu_model
from cli.store.home import quill_home
from quant.gguf import GGUFHeader
from quant.memory import ModelShape
from quant.partfiles import write_replacing

PASSES, READS = 4, 4  # best of 4 passes, each reading the buffer 4 times (fewer overheads)
# A float32 dot of each thread's slice with itself reads every byte once through OpenBLAS's
# SIMD kernel, without the GIL: here (2-core EPYC VM, 2 threads) 45 GB/s, two processes 44, numpy's
# sum() of float64 33; llama.cpp's decode of an 8B-class Q4_K_M read 37 (docs/bench.md).
# Looked up once per token, a row each: the whole table is not read.
LOOKUP_TABLES = ("position_embd.weight", "token_types.weight", "per_layer_token_embd.weight")


@dataclass(frozen=True)
class Bandwidth:
    gb_per_s: float
    threads: int
    method: str
    measured_on: str  # ISO date
    busy_elsewhere: float = 0.0  # cores' worth of other processes' CPU time meanwhile
    cached: bool = False  # read from the cache file, not measured in this process

    def describe(self) -> str:
        if self.busy_elsewhere >= BUSY_SHARE:
            when = (
                f"measured now while other processes kept {self.busy_elsewhere:.1f} cores busy, "
                "so likely too low: not kept, the next run measures again"
            )
        else:
            when = f"measured {self.measured_on if self.cached else 'now'}, kept in {cache_path()}"
        return (
            f"memory read bandwidth with {self.threads} threads: {self.gb_per_s:.1f} GB/s "
            f"({self.method}; {when})"
        )


def cache_path() -> Path:
    return quill_home() / "bandwidth.json"


def buffer_bytes() -> int:
    """4x the last-level caches together (sysfs: each L3 once), at least 512 MiB (16x here)."""
    caches = {}
    for folder in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        with contextlib.suppress(OSError, ValueError):
            shared = (folder / "shared_cpu_list").read_text()
            caches[shared] = int((folder / "size").read_text().strip().removesuffix("K")) << 10
    return max(512 << 20, 4 * sum(caches.values()))


def measure_read_bandwidth(threads: int, size: int) -> float:
    """GB/s that `threads` threads read together, each its own slice of one buffer."""
    import numpy as np

    slices = np.array_split(np.ones(size // 4, np.float32), threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(PASSES):
            started = time.perf_counter()
            list(pool.map(lambda part: [np.dot(part, part) for _ in range(READS)], slices))
            best = max(best, READS * size / (time.perf_counter() - started) / 1e9)
    return best


_NOT_KEPT: dict[tuple[Path, str], Bandwidth] = {}  # measured beside busy processes: once a run


def read_bandwidth(threads: int) -> Bandwidth:
    """This machine's read bandwidth with `threads` threads: from the cache, else measured now
    (about a second) and cached."""
    key = f"{cpu_model()}, {threads} threads"
    path = cache_path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    try:
        return Bandwidth(**known[key], cached=True)
    except (KeyError, TypeError):  # not measured yet, or a file of another shape
        known = known if isinstance(known, dict) else {}
    if (path, key) in _NOT_KEPT:
        return _NOT_KEPT[path, key]
    restart_window()
    size = buffer_bytes()
    gb_per_s = round(measure_read_bandwidth(threads, size), 2)
    busy = round(measure_free_cores().busy_elsewhere, 2)
    method = f"numpy float32 dot, {size >> 20} MiB split over the threads, best of {PASSES}"
    today = datetime.date.today().isoformat()
    measured = Bandwidth(gb_per_s, threads, method, today, busy)
    if busy >= BUSY_SHARE:
        _NOT_KEPT[path, key] = measured
        return measured
    known[key] = {k: v for k, v in asdict(measured).items() if k != "cached"}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_replacing(path, json.dumps(known, indent=1) + "\n")
    return measured


def weights_read_per_token(header: GGUFHeader) -> int:
    """Bytes of weights one decode step reads: every tensor, but of a lookup table only one row
    (the token embeddings too, unless the output matrix is tied to them and reads them whole),
    and of MoE expert tensors only the experts the token is routed to."""
    names = {tensor.name for tensor in header.tensors}
    arch = header.get("general.architecture")
    experts = int(header.get(f"{arch}.expert_count", 0) or 0)
    used = int(header.get(f"{arch}.expert_used_count", 0) or 0)
    lookups = LOOKUP_TABLES + (("token_embd.weight",) if "output.weight" in names else ())
    total = 0
    for tensor in header.tensors:
        if tensor.name in lookups:
            total += tensor.n_bytes // tensor.shape[-1]
        elif "_exps." in tensor.name and experts:
            total += tensor.n_bytes * used // experts
        else:
            total += tensor.n_bytes
    return total


def kv_read_per_token(shape: ModelShape, depth: float, kv_type: str) -> int:
    """Bytes of K and V cache one decode step reads at this depth: every position of the full
    attention layers, at most the window's of sliding-window layers (flash attention skips the
    positions its mask hides)."""
    swa = [i for i, windowed in enumerate(shape.swa_layers) if windowed]
    full = [i for i in range(shape.n_layers) if i not in set(swa)]
    seen = min(depth, shape.sliding_window) if swa else 0
    per_position = shape.kv_bytes(1, kv_type, kv_type, full)
    return int(per_position * depth + shape.kv_bytes(1, kv_type, kv_type, swa) * seen)

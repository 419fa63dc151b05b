"""The physical limit of decode: how many bytes a step reads, and how fast this machine's memory
can deliver them. The bandwidth is measured once per CPU model and thread count and kept in
QUILL_HOME/bandwidth.json (delete the file to measure again)."""

from __future__ import annotations

import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from cli.engine.hardware import cpu_model
from cli.store.home import quill_home
from quant.gguf import GGUFHeader
from quant.memory import ModelShape
from quant.partfiles import write_replacing

BUFFER_BYTES = 1 << 30  # far past any desktop's last-level cache (32 MiB here)
PASSES = 8
# A float32 dot of each thread's slice with itself reads every byte once through OpenBLAS's
# AVX kernels, without the GIL. Here (2-core EPYC, 2 threads) it reads about as fast as llama.cpp
# decodes a 7B model; numpy's sum() of float64 reaches only a quarter of that.
METHOD = f"numpy float32 dot over {BUFFER_BYTES >> 30} GiB, a slice per thread, best of {PASSES}"
# Looked up once per token, a row each: the whole table is not read.
LOOKUP_TABLES = ("position_embd.weight", "token_types.weight", "per_layer_token_embd.weight")


@dataclass(frozen=True)
class Bandwidth:
    gb_per_s: float
    threads: int
    method: str
    measured_on: str  # ISO date
    cached: bool = False  # read from the cache file, not measured in this process

    def describe(self) -> str:
        when = f"measured {self.measured_on}" if self.cached else "measured now"
        return (
            f"memory read bandwidth with {self.threads} threads: {self.gb_per_s:.1f} GB/s "
            f"({self.method}; {when}, kept in {cache_path()})"
        )


def cache_path() -> Path:
    return quill_home() / "bandwidth.json"


def measure_read_bandwidth(threads: int) -> float:
    """GB/s that `threads` threads read together, each its own slice of one buffer."""
    import numpy as np

    slices = np.array_split(np.ones(BUFFER_BYTES // 4, np.float32), threads)
    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(PASSES):
            started = time.perf_counter()
            list(pool.map(lambda part: np.dot(part, part), slices))
            best = max(best, BUFFER_BYTES / (time.perf_counter() - started) / 1e9)
    return best


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
    today = datetime.date.today().isoformat()
    measured = Bandwidth(round(measure_read_bandwidth(threads), 2), threads, METHOD, today)
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

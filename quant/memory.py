"""How much memory a model needs at a given context, as llama.cpp (the version quill ships
with) allocates it on the CPU: the context rounded up to a multiple of 256 cells; the KV cache
(quant.kv) over the full context for sliding-window layers too (llama.cpp's swa_full, its C
default, which lets the prefix cache reuse a conversation; a windowed cache is reported beside
it); with flash attention, a compute buffer of n_ubatch x 4 bytes x (vocabulary + 2 x embedding
length) and an output buffer of vocabulary x 4 bytes. These match llama.cpp's own report for
SmolLM2 and Gemma 3 with an f16 cache; with a quantized one its graph allocator takes 1-5% more
(SmolLM2 at 768 and 4096 cells), and GPU backends allocate differently: the compute figure is an
estimate, the KV figure exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from quant.gguf import (
    LAYERS,
    GGUFHeader,
    described,
    head_dims,
    hyperparameters,
    read_header,
    refused,
)
from quant.kv import kv_cache_bytes

CELL_PADDING = 256
MAX_CELLS = 2**32 - CELL_PADDING  # llama.cpp's n_ctx is a uint32
# Sliding-window layer patterns llama.cpp applies when the GGUF does not list them: the period,
# whose last layer is full attention.
SWA_PERIODS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "llama4": 4, "gpt-oss": 2}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know about a model, read from its GGUF header."""

    architecture: str
    n_layers: int
    kv_heads: tuple[int, ...]  # per layer
    head_dim_k: int
    head_dim_v: int
    n_embd: int
    n_vocab: int
    trained_ctx: int
    weights_bytes: int
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()

    @classmethod
    def from_gguf(cls, path: Path) -> ModelShape:
        """Raises quant.gguf.GGUFError for a file that is not a readable GGUF."""
        return cls.from_header(read_header(path))

    @classmethod
    def from_header(cls, header: GGUFHeader) -> ModelShape:
        """Raises GGUFError naming a field of the wrong type or past llama.cpp's limits."""
        model = hyperparameters(header)
        arch, n_layers = model.architecture, model.layers or 0
        heads = model.heads if model.heads is not None else 1
        kv = model.kv_heads if model.kv_heads is not None else heads
        kv_heads = tuple(kv) if isinstance(kv, list) else (kv,) * n_layers
        dims = head_dims(header.get)  # K and V values per head
        window = model.sliding_window or 0
        pattern = sliding_window_pattern(header, arch)
        if window and isinstance(pattern, list):
            swa = tuple(bool(x) for x in pattern[:n_layers])
        elif window and arch in SWA_PERIODS:
            swa = tuple(i % SWA_PERIODS[arch] < SWA_PERIODS[arch] - 1 for i in range(n_layers))
        else:
            # An unknown sliding-window architecture: counted as full attention everywhere.
            swa = (False,) * n_layers
        n_vocab = header.array_lengths.get("tokenizer.ggml.tokens", 0)
        weights = sum(t.n_bytes for t in header.tensors)
        trained_ctx = model.context_length or 0
        return cls(
            arch, n_layers, kv_heads, *dims, model.embedding_length or 0, n_vocab, trained_ctx,
            weights, window, swa,
        )  # fmt: skip

    def kv_bytes(
        self, cells: int, type_k: str, type_v: str, layers: list[int] | None = None
    ) -> int:
        """The K and V caches of these layers (all by default) at this many cells."""
        heads = self.kv_heads if layers is None else [self.kv_heads[i] for i in layers]
        return kv_cache_bytes(
            len(heads), heads, self.head_dim_k, cells, type_k, type_v, self.head_dim_v
        )


def sliding_window_pattern(header: GGUFHeader, arch: str) -> list[bool] | int | None:
    """Which layers have a sliding window: a flag a layer, or a period (llama.cpp's
    load_swa_pattern reads either: an array of bools or whole numbers of at most its 512 layers,
    or one whole number)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = header.get(key)
    if not isinstance(pattern, list):
        return header.integer(key)
    if len(pattern) > LAYERS.most or not all(isinstance(flag, int) for flag in pattern):
        raise refused(header.where, f"{key} is {described(pattern)}, not one flag a layer")
    return pattern


@dataclass(frozen=True)
class MemoryPlan:
    n_ctx: int  # cells, after llama.cpp's rounding
    type_k: str
    type_v: str
    weights_bytes: int
    kv_bytes: int
    kv_bytes_windowed: int  # what the KV cache would take with sliding-window layers windowed
    compute_bytes: int
    output_bytes: int
    # Beside the model: a server's parked prompt caches (serve --cache-ram), a draft model's own
    # weights, KV cache and buffers at the same context (--spec draft).
    parked_bytes: int = 0
    draft_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        beside = self.parked_bytes + self.draft_bytes
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes + beside

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def padded(n_ctx: int) -> int:
    return -(-n_ctx // CELL_PADDING) * CELL_PADDING


def plan(
    shape: ModelShape,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str | None = None,
    *,
    draft: ModelShape | None = None,
    parked_bytes: int = 0,
    n_ubatch: int = 512,
) -> MemoryPlan:
    """The memory of a model loaded at n_ctx, with parked prompt caches up to parked_bytes and
    a draft model (loaded at the same context and KV types) where given."""
    type_v = type_v or type_k
    cells = padded(n_ctx)
    n_ubatch = min(n_ubatch, cells)
    swa = [i for i, is_swa in enumerate(shape.swa_layers) if is_swa]
    full = sorted(set(range(shape.n_layers)) - set(swa))
    window_cells = min(cells, padded(shape.sliding_window + n_ubatch)) if swa else 0
    windowed = shape.kv_bytes(cells, type_k, type_v, full)
    windowed += shape.kv_bytes(window_cells, type_k, type_v, swa)
    draft_bytes = plan(draft, n_ctx, type_k, type_v, n_ubatch=n_ubatch).total_bytes if draft else 0
    return MemoryPlan(
        n_ctx=cells,
        type_k=type_k,
        type_v=type_v,
        weights_bytes=shape.weights_bytes,
        kv_bytes=shape.kv_bytes(cells, type_k, type_v),
        kv_bytes_windowed=windowed,
        compute_bytes=n_ubatch * 4 * (shape.n_vocab + 2 * shape.n_embd),
        output_bytes=shape.n_vocab * 4,
        parked_bytes=parked_bytes,
        draft_bytes=draft_bytes,
    )


def layer_split(free_bytes: Sequence[int], n_layers: int, offloaded: int) -> list[int | None]:
    """The device each of n_layers layers, then the output layer, lands on (None: the host's
    CPU), as llama.cpp splits them (llama_model::load_tensors): in proportion to each device's
    free memory, the last `offloaded` of the n_layers + 1 slots leaving the host."""
    total = sum(free_bytes) or 1
    bounds, running = [], 0
    for free in free_bytes:
        running += free
        bounds.append(running / total)
    active = min(offloaded, n_layers + 1) if free_bytes else 0
    start = max(n_layers + 1 - offloaded, 0)
    placement: list[int | None] = []
    for layer in range(n_layers + 1):
        if layer < start or layer - start >= active:
            placement.append(None)
        else:  # llama.cpp's upper_bound over the cumulative shares
            share = (layer - start) / active
            placement.append(next((i for i, b in enumerate(bounds) if b > share), len(bounds) - 1))
    return placement


@dataclass(frozen=True)
class DeviceShare:
    """What one device holds of a split model: its layers, their weights and KV cache."""

    device: str  # "CPU" for the host
    layers: tuple[int, ...]  # the output layer counts as n_layers
    weights_bytes: int
    kv_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layers": list(self.layers)}


def split_plan(
    header: GGUFHeader,
    devices: Sequence[tuple[str, int]],
    offloaded: int,
    n_ctx: int,
    type_k: str = "f16",
    type_v: str | None = None,
) -> list[DeviceShare]:
    """Who holds what when a model is split across devices ((name, free bytes) each) with
    `offloaded` layers leaving the host: the host first (input embeddings, layers kept), then
    each device, weights summed from the header's tensors, KV per layer."""
    shape = ModelShape.from_header(header)
    placement = layer_split([free for _, free in devices], shape.n_layers, offloaded)
    weights: dict[int | None, int] = {}
    layers: dict[int | None, list[int]] = {}
    embeddings = 0
    for layer, device in enumerate(placement):
        layers.setdefault(device, []).append(layer)
    for tensor in header.tensors:
        match = re.match(r"blk\.(\d+)\.", tensor.name)
        if match and int(match.group(1)) < shape.n_layers:
            owner = placement[int(match.group(1))]
        elif tensor.name.startswith(("output.", "output_norm")):
            owner = placement[shape.n_layers]
        else:  # token embeddings and the like: llama.cpp keeps the input layer on the host
            owner = None
        weights[owner] = weights.get(owner, 0) + tensor.n_bytes
        if tensor.name == "token_embd.weight":
            embeddings = tensor.n_bytes
    # Tied embeddings (no output.weight) on an output layer off the host: llama.cpp loads
    # token_embd a second time there.
    output = placement[shape.n_layers]
    if output is not None and not any(t.name == "output.weight" for t in header.tensors):
        weights[output] = weights.get(output, 0) + embeddings
    cells = padded(n_ctx)
    shares = []
    for index, name in [(None, "CPU"), *enumerate(name for name, _ in devices)]:
        held = [layer for layer in layers.get(index, []) if layer < shape.n_layers]
        kv = shape.kv_bytes(cells, type_k, type_v or type_k, held) if held else 0
        owned = tuple(layers.get(index, []))
        shares.append(DeviceShare(name, owned, weights.get(index, 0), kv))
    return shares


def largest_context(
    shape: ModelShape,
    budget_bytes: int,
    type_k: str = "f16",
    type_v: str | None = None,
    parked_bytes: int = 0,
    draft: ModelShape | None = None,
) -> int:
    """The longest context (a multiple of 256, at most the trained one) whose plan, parked
    caches and draft model included, fits the budget; 0 when not even 256 cells fit."""

    def total(cells: int) -> int:
        return plan(
            shape, cells, type_k, type_v, parked_bytes=parked_bytes, draft=draft
        ).total_bytes

    # At 512 cells and more the batch, hence the compute buffer, no longer grows with the
    # context: the plan is a line from there on.
    low, high = 2 * CELL_PADDING, 4 * CELL_PADDING
    per_cell = (total(high) - total(low)) / (high - low)
    fixed = total(low) - per_cell * low
    if budget_bytes <= fixed:
        cells = 0
    elif per_cell > 0:
        cells = min(int((budget_bytes - fixed) // per_cell), MAX_CELLS)
    else:  # no KV cache (no layers, or no heads): no context costs more than another
        cells = MAX_CELLS
    cells -= cells % CELL_PADDING
    if shape.trained_ctx:
        cells = min(cells, shape.trained_ctx - shape.trained_ctx % CELL_PADDING)
    while cells > 0 and total(cells) > budget_bytes:
        cells -= CELL_PADDING
    if cells == 0 and total(CELL_PADDING) <= budget_bytes:
        cells = CELL_PADDING
    return cells


MAX_SIZE = 1 << 60  # 1 EiB: more than any disk or memory, and far from a float's limits
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1.5gb', '1048576' -> bytes: binary units (G and GB count as GiB),
    0 allowed (it means none: no parked caches, no prompt cache, a budget nothing fits).
    ValueError for anything else, and for sizes past 1 EiB (a 400-digit number overflows a
    float)."""
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise ValueError(f"not a size: {shown}; write it like 4GiB or 512MiB")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if value > MAX_SIZE:
        raise ValueError(f"{shown} is more than 1 EiB; write a size like 4GiB or 512MiB")
    return int(value)

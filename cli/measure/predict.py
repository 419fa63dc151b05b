"""Decode speed predicted from a model's GGUF header alone, before a byte of its weights is here:
`quill pull` shows it for each file of a repository, and `quill bench` checks it on its tg rows.

The rule, in seconds a token, on this CPU with a thread count:

    Σ over weight types T: bytes of T a step reads / (B x share[T])
  + bytes of norms and of the KV cache a step reads / B
  + layers x Σ over T: (T's part of the layers' bytes) x per_layer[T]
  + per_token + vocabulary x per_vocab_entry
  + positions in the cache x layers x query heads x attention[KV type]

B is this machine's read bandwidth with that many threads (bandwidth.py: measured once, cached);
the bytes a step reads are bandwidth.py's too (weights_read_per_token, kv_read_per_token), split
by tensor type. share[T] is the part of B llama.cpp's decode reaches on large matrices of type T:
0.8-0.9 where its kernel keeps up with memory (Q4_K, Q6_K, Q8_0 on a 2-core EPYC VM; F16 about
1), well under where it computes slower than memory delivers (Q4_1 0.55-0.6 there). per_layer[T]
is what a layer of T costs beyond its bytes: its small operations and the start of each matrix's
read (50-100 us there: 40% of SmolLM2-135M's 5.5 ms a token, 2% of an 8B's 110 ms). The rest is
the call and the sampler over the vocabulary, and attention's arithmetic over the cache (83% of
what 4096 cached positions add to SmolLM2's token, their bytes the rest).

None of it comes from the model predicted. The first prediction with a thread count measures the
terms on synthetic replicas (quant/replica.py's noise weights, under llama headers written here,
in a temporary folder under QUILL_HOME/cache), two models loaded at a time and decoding in turns
so that a slow spell of a shared machine falls on both: a tiny model whose weights sit in the
caches (per_token) and the same with a 64k vocabulary (per_vocab_entry); for each weight type a
prediction meets, a deep narrow and a wide shallow model of that type, of equal bytes, 4x the
last-level caches at least (their two equations give share[T] and per_layer[T]); for each KV
type, a small model at depths 0 and ATTENTION_DEPTH (attention). About 2 s a weight type, 5-7 s
for a first Q4_K_M model here. A measurement beside AGAIN_BUSY of a core of other work is taken
again. Each part is kept in QUILL_HOME/predict.json under the CPU model, the thread count and the
llama.cpp build, with the bandwidth its shares are of: when any of these changes, it is measured
again. Parts measured while other processes kept BUSY_SHARE of a core busy are used by this
process and not kept, as bandwidth.py does with its measurement.
benchmarks/results/predict-decode-2026-12-03.md compares the rule with quill bench.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cli.engine.freecores import BUSY_SHARE
from cli.engine.hardware import cpu_model
from cli.measure.bandwidth import (
    Bandwidth,
    kv_read_per_token,
    read_bandwidth,
    weights_read_per_token,
)
from cli.store.home import quill_home
from quant.gguf import GGML_TYPES, GGUFHeader, TensorInfo, hyperparameters
from quant.memory import ModelShape
from quant.partfiles import write_replacing

VECTORS = "vectors"  # norms and biases, read at B itself: a few KB a layer
STAND_IN = "Q4_K"  # a weight type quill cannot make a replica of is predicted as this one
TOKENS, ROUNDS = 16, 5  # a measurement: the median of ROUNDS rounds of TOKENS, after a warm-up
AGAIN_BUSY, ATTEMPTS = 0.1, 3  # a measurement beside this many cores of other work is taken again
ATTENTION_DEPTH = 1024  # cached positions where attention's cost is measured
MIN_WIDE_BYTES = 128 << 20  # a wide or deep model's weights: at least this (4x the L3 here)
MADE_FOR = "quill's decode calibration"  # the replicas' quill.replica_of


@dataclass(frozen=True)
class Synthetic:
    """A llama model made to calibrate with: tied embeddings, every matrix of weight_type."""

    name: str
    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 512
    weight_type: str = "Q4_K"

    def tensors(self) -> list[tuple[str, int, int]]:
        """(name, rows, row length) of each tensor; a norm's row length is 0."""
        kv_width = self.width // self.heads * self.kv_heads
        found = [("token_embd.weight", self.vocab, self.width)]
        for layer in range(self.layers):
            block = f"blk.{layer}"
            found += [
                (f"{block}.attn_norm.weight", self.width, 0),
                (f"{block}.attn_q.weight", self.width, self.width),
                (f"{block}.attn_k.weight", kv_width, self.width),
                (f"{block}.attn_v.weight", kv_width, self.width),
                (f"{block}.attn_output.weight", self.width, self.width),
                (f"{block}.ffn_norm.weight", self.width, 0),
                (f"{block}.ffn_gate.weight", self.ffn, self.width),
                (f"{block}.ffn_up.weight", self.ffn, self.width),
                (f"{block}.ffn_down.weight", self.width, self.ffn),
            ]
        return [*found, ("output_norm.weight", self.width, 0)]

    def tensor_bytes(self, rows: int, cols: int) -> int:
        _, block, size = GGML_TYPES[type_id(self.weight_type)]
        return rows * cols // block * size if cols else rows * 4

    @property
    def weights_bytes(self) -> int:
        """What a step reads: every tensor (the token table is the output matrix too)."""
        return sum(self.tensor_bytes(rows, cols) for _, rows, cols in self.tensors())

    def deep_enough(self, least: int) -> Synthetic:
        """With as many layers as make its weights at least `least` bytes."""
        one = replace(self, layers=1).weights_bytes - replace(self, layers=0).weights_bytes
        return replace(self, layers=max(1, math.ceil(least / one)))


TINY = Synthetic("tiny", layers=2, width=256, ffn=768, heads=4, kv_heads=2)
TINY_VOCAB = replace(TINY, name="tiny-vocab", vocab=65536)  # its header takes 0.3 s to write
# A type's two models, given layers by deep_enough: small matrices and large ones.
DEEP = Synthetic("deep", layers=0, width=512, ffn=1536, heads=8, kv_heads=2)
WIDE = Synthetic("wide", layers=0, width=2048, ffn=6144, heads=32, kv_heads=8)
ATTENTION = Synthetic("attention", layers=8, width=512, ffn=1536, heads=8, kv_heads=2)


def type_id(name: str) -> int:
    """ggml's number for a type name (StopIteration where ggml has none)."""
    return next(number for number, (known, _, _) in GGML_TYPES.items() if known == name)


@dataclass(frozen=True)
class DecodeCalibration:
    """The terms a prediction takes besides the header, for one thread count."""

    threads: int
    build: str  # llama.cpp's, as llama_build() names it
    bandwidth: Bandwidth  # B: the shares are of its gb_per_s
    per_token_s: float
    per_vocab_entry_s: float
    shares: Mapping[str, float]  # weight type: the part of B decode reaches on its matrices
    per_layer_s: Mapping[str, float]  # weight type: a layer's cost beyond its bytes
    attention_s: Mapping[str, float]  # KV type: seconds a position x layer x query head
    measured_on: str  # ISO date the base terms were measured
    seconds: float = 0.0  # spent measuring in this process (0: all from the cache)
    busy_elsewhere: float = 0.0  # the most other processes kept busy while parts were measured
    unmade: tuple[str, ...] = ()  # weight types quill cannot make: STAND_IN's terms stand in

    @property
    def kept(self) -> bool:
        return self.busy_elsewhere < BUSY_SHARE

    def describe(self) -> str:
        """One line: the terms, and whether they were measured now and kept."""
        types = ", ".join(
            f"{kind} {share:.0%} + {self.per_layer_s[kind] * 1e6:.0f} us a layer"
            for kind, share in sorted(self.shares.items())
        )
        terms = (
            f"decode prediction with {self.threads} threads: weights read at {types} (of "
            f"{self.bandwidth.gb_per_s:.1f} GB/s); {self.per_token_s * 1e3:.2f} ms + "
            f"{self.per_vocab_entry_s * 1e9:.1f} ns a vocabulary entry a token"
        )
        if not self.seconds:
            return f"{terms} (calibrated {self.measured_on}, kept in {cache_path()})"
        if not self.kept:
            return (
                f"{terms} (calibrated now in {self.seconds:.1f} s while other processes kept "
                f"{self.busy_elsewhere:.1f} cores busy, so likely off: not kept, the next run "
                "measures again)"
            )
        return f"{terms} (calibrated now in {self.seconds:.1f} s, kept in {cache_path()})"


@dataclass(frozen=True)
class DecodePrediction:
    tokens_per_s: float
    seconds_per_token: float
    bytes_per_token: int  # weights + KV cache a step reads, as quill bench counts them
    bytes_by_type: Mapping[str, int]  # the weights by tensor type (norms: VECTORS)
    kv_bytes: int
    read_s: float  # the bytes' time: weights at their types' shares of B, the rest at B
    overhead_s: float  # the call, the layers, the vocabulary's sampling
    attention_s: float  # arithmetic over the cached positions
    n_layers: int
    n_vocab: int
    depth: float  # positions in the cache (a tgN row's mean: D + 1 + N/2)
    kv_type: str
    threads: int
    bandwidth_gb_per_s: float
    shares: Mapping[str, float]  # of this model's weight types
    uncalibrated: tuple[str, ...] = ()  # of its types: predicted with BASE_TYPE's share

    @property
    def limited_by(self) -> str:
        return "memory" if self.read_s >= self.overhead_s + self.attention_s else "overheads"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"limited_by": self.limited_by}

    def describe(self) -> str:
        return (
            f"predicted decode {self.tokens_per_s:.1f} tok/s with {self.threads} threads: "
            f"{self.bytes_per_token / 1e6:.1f} MB a token read in {self.read_s * 1e3:.2f} ms, "
            f"{self.overhead_s * 1e3:.2f} ms for {self.n_layers} layers and the call, "
            f"{self.attention_s * 1e3:.2f} ms of attention at depth {self.depth:.0f} "
            f"({self.limited_by}-bound)"
        )


def cache_path() -> Path:
    return quill_home() / "predict.json"


def llama_build() -> str:
    """llama-cpp-python's version and a digest of its libraries' names and sizes (a rebuild
    with other CMAKE_ARGS keeps the version), read from its files: no import."""
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return "llama-cpp-python missing"
    spec = importlib.util.find_spec("llama_cpp")
    digest = hashlib.sha256()
    if spec and spec.origin:
        for library in sorted((Path(spec.origin).parent / "lib").glob("*.so*")):
            with contextlib.suppress(OSError):
                digest.update(f"{library.name} {library.stat().st_size}\n".encode())
    return f"llama-cpp-python {version} ({digest.hexdigest()[:8]})"


def calibration_key(threads: int) -> str:
    return f"{cpu_model()}, {threads} threads, {llama_build()}"


def weights_read_by_type(header: GGUFHeader) -> dict[str, int]:
    """weights_read_per_token's bytes split by tensor type (tensors of one dimension: VECTORS)."""
    names = {tensor.name for tensor in header.tensors}
    # The rule reads a token table whole when it is also the output matrix, which it tells by
    # the names: an empty output.weight keeps that fact in each group, and adds no bytes.
    stand_in = [TensorInfo("output.weight", (0,), 0)] if "output.weight" in names else []
    groups: dict[str, list[TensorInfo]] = {}
    for tensor in header.tensors:
        groups.setdefault(_kind(tensor), []).append(tensor)
    return {
        kind: weights_read_per_token(replace(header, tensors=[*group, *stand_in]))
        for kind, group in groups.items()
    }


def _kind(tensor: TensorInfo) -> str:
    return tensor.type_name if len([n for n in tensor.shape if n > 1]) > 1 else VECTORS


def layer_parts(header: GGUFHeader) -> dict[str, float]:
    """Each matrix type's part of the layers' bytes (the blk.N tensors)."""
    sizes: dict[str, int] = {}
    for tensor in header.tensors:
        if tensor.name.startswith("blk.") and _kind(tensor) != VECTORS:
            sizes[_kind(tensor)] = sizes.get(_kind(tensor), 0) + tensor.n_bytes
    total = sum(sizes.values()) or 1
    return {kind: size / total for kind, size in sizes.items()}


def query_heads(header: GGUFHeader) -> int:
    """Query heads summed over the layers: what attention multiplies each cached position by."""
    model = hyperparameters(header)
    heads = model.heads if model.heads is not None else 1
    return sum(heads) if isinstance(heads, list) else heads * (model.layers or 0)


def predict_decode(
    header: GGUFHeader,
    threads: int,
    depth: float = 0,
    kv_type: str = "f16",
    calibration: DecodeCalibration | None = None,
) -> DecodePrediction:
    """Decode tokens/s of the model this header starts, here with `threads` threads, `depth`
    positions into a KV cache of kv_type. Without a calibration, decode_calibration's for the
    model's types (measured first where the cache lacks a part: seconds, once)."""
    by_type = weights_read_by_type(header)
    matrix_types = sorted(kind for kind in by_type if kind != VECTORS)
    if calibration is None:
        calibration = decode_calibration(threads, matrix_types, (kv_type,))
    shape = ModelShape.from_header(header)
    bandwidth = calibration.bandwidth.gb_per_s * 1e9

    def term(terms: Mapping[str, float], kind: str) -> float:
        return terms[kind] if kind in terms else terms[STAND_IN]

    kv_bytes = kv_read_per_token(shape, depth, kv_type)
    read_s = sum(
        by_type[kind] / (bandwidth * term(calibration.shares, kind)) for kind in matrix_types
    )
    read_s += (by_type.get(VECTORS, 0) + kv_bytes) / bandwidth
    per_layer = sum(
        part * term(calibration.per_layer_s, kind) for kind, part in layer_parts(header).items()
    )
    overhead_s = (
        calibration.per_token_s
        + shape.n_layers * per_layer
        + shape.n_vocab * calibration.per_vocab_entry_s
    )
    attention_s = depth * query_heads(header) * calibration.attention_s.get(kv_type, 0.0)
    seconds = read_s + overhead_s + attention_s
    return DecodePrediction(
        tokens_per_s=1 / seconds,
        seconds_per_token=seconds,
        bytes_per_token=sum(by_type.values()) + kv_bytes,
        bytes_by_type=by_type,
        kv_bytes=kv_bytes,
        read_s=read_s,
        overhead_s=overhead_s,
        attention_s=attention_s,
        n_layers=shape.n_layers,
        n_vocab=shape.n_vocab,
        depth=depth,
        kv_type=kv_type,
        threads=threads,
        bandwidth_gb_per_s=calibration.bandwidth.gb_per_s,
        shares={kind: term(calibration.shares, kind) for kind in matrix_types},
        uncalibrated=tuple(kind for kind in matrix_types if kind not in calibration.shares),
    )


# ---- calibration ------------------------------------------------------------------------------

# Measured beside busy processes: (what the cache entry would hold, the calibration), a run's.
_NOT_KEPT: dict[tuple[Path, str], tuple[dict[str, Any], DecodeCalibration]] = {}


def decode_calibration(
    threads: int,
    weight_types: Collection[str] = (STAND_IN,),
    kv_types: Collection[str] = ("f16",),
) -> DecodeCalibration:
    """The terms for `threads` threads, holding these weight and KV types: from the cache, else
    measured now (the parts it lacks) and kept. One process measures at a time: two measuring
    at once would each slow the other's models (and keep neither, as busy), so a second one
    waits, then finds in the cache what the first kept."""
    from filelock import FileLock

    key, path = calibration_key(threads), cache_path()
    bandwidth = read_bandwidth(threads)
    wanted = ({*weight_types, STAND_IN}, set(kv_types))
    entry, earlier = _cached_entry(path, key, bandwidth)
    if not _lacks(entry, *wanted):
        return _used(Calibrating(entry, threads, bandwidth).measure_missing(*wanted), earlier)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.lock"):
        entry, earlier = _cached_entry(path, key, bandwidth)  # with what a process before kept
        calibration = _used(
            Calibrating(entry, threads, bandwidth).measure_missing(*wanted), earlier
        )
        if calibration.seconds and calibration.kept:
            known = read_cache(path)
            known[key] = entry
            write_replacing(path, json.dumps(known, indent=1) + "\n")
        elif calibration.seconds:
            _NOT_KEPT[path, key] = (entry, calibration)
    return calibration


def _used(calibration: DecodeCalibration, earlier: DecodeCalibration | None) -> DecodeCalibration:
    """calibration, or where its terms are this process's own measured busy (earlier), said
    again to be those: their seconds and how busy the machine was."""
    if earlier is None:
        return calibration
    seconds = earlier.seconds + calibration.seconds
    busy = max(earlier.busy_elsewhere, calibration.busy_elsewhere)
    return replace(calibration, seconds=seconds, busy_elsewhere=busy)


def _cached_entry(
    path: Path, key: str, bandwidth: Bandwidth
) -> tuple[dict[str, Any], DecodeCalibration | None]:
    """The cache's entry for key (or this process's own, measured busy and not kept), with the
    calibration that measured it busy; a fresh entry where the bandwidth changed."""
    entry, earlier = _NOT_KEPT.get((path, key), (read_cache(path).get(key), None))
    if not isinstance(entry, dict) or entry.get("bandwidth_gb_per_s") != bandwidth.gb_per_s:
        return {"bandwidth_gb_per_s": bandwidth.gb_per_s}, None
    return entry, earlier


def _lacks(entry: Mapping[str, Any], weight_types: set[str], kv_types: set[str]) -> bool:
    base, types, attention = entry.get("base"), entry.get("types"), entry.get("attention_s")
    names = ("per_token_s", "per_vocab_entry_s", "measured_on")
    return not (
        isinstance(base, dict)
        and all(name in base for name in names)
        and isinstance(types, dict)
        and weight_types <= types.keys()
        and isinstance(attention, dict)
        and kv_types <= attention.keys()
    )


def read_cache(path: Path) -> dict[str, Any]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


class Calibrating:
    """Measures what a cache entry lacks into it, two synthetic models at a time."""

    def __init__(self, entry: dict[str, Any], threads: int, bandwidth: Bandwidth) -> None:
        self.entry, self.threads, self.bandwidth = entry, threads, bandwidth
        self.measured = 0  # synthetic models
        self.busy = 0.0  # the most other processes kept busy beside a measurement that counts

    def timed(self, cases: Sequence[Case], kv_type: str = "f16") -> list[float]:
        """measure_synthetic's, taken again (ATTEMPTS in all at most, the quietest counting)
        while other processes keep AGAIN_BUSY of a core busy beside it: llama.cpp's threads
        wait for each other at every operation, so a burst elsewhere of a second or two in a
        calibration of seconds moves a term by a third."""
        tries: list[tuple[float, list[float]]] = []
        while len(tries) < ATTEMPTS and (not tries or tries[-1][0] >= AGAIN_BUSY):
            since = cpu_seconds()
            seconds = measure_synthetic(cases, self.threads, kv_type)
            tries.append((busy_elsewhere(since), seconds))
        busy, seconds = min(tries, key=lambda attempt: attempt[0])
        self.measured, self.busy = self.measured + len(cases), max(self.busy, busy)
        return seconds

    def measure_missing(self, weight_types: set[str], kv_types: set[str]) -> DecodeCalibration:
        started, entry = time.monotonic(), self.entry
        base = entry.get("base")
        names = ("per_token_s", "per_vocab_entry_s", "measured_on")
        if not (isinstance(base, dict) and all(name in base for name in names)):
            base = entry["base"] = self.base_terms()
            entry["types"] = {}
        types, attention = entry.setdefault("types", {}), entry.setdefault("attention_s", {})
        unmade = []
        for kind in sorted(weight_types - set(types)):
            terms = self.terms_of(kind, base)
            if terms is None:
                unmade.append(kind)
            else:
                types[kind] = terms
        for kv_type in sorted(kv_types - set(attention)):
            attention[kv_type] = self.attention_of(kv_type)
        return DecodeCalibration(
            threads=self.threads,
            build=llama_build(),
            bandwidth=self.bandwidth,
            per_token_s=base["per_token_s"],
            per_vocab_entry_s=base["per_vocab_entry_s"],
            shares={kind: terms["share"] for kind, terms in types.items()},
            per_layer_s={kind: terms["per_layer_s"] for kind, terms in types.items()},
            attention_s=dict(attention),
            measured_on=base["measured_on"],
            seconds=round(time.monotonic() - started, 2) if self.measured else 0.0,
            busy_elsewhere=round(self.busy, 2),
            unmade=tuple(unmade),
        )

    def base_terms(self) -> dict[str, Any]:
        """per_token and per_vocab_entry from two tiny models whose weights sit in the caches:
        the one's time is the call's; the other's is more by its larger vocabulary's sampling
        (and its output matrix, taken off at B)."""
        tiny, vocab = self.timed([(TINY, 0), (TINY_VOCAB, 0)])
        more_bytes = TINY_VOCAB.weights_bytes - TINY.weights_bytes
        sampling = vocab - tiny - more_bytes / (self.bandwidth.gb_per_s * 1e9)
        per_entry = max(0.0, sampling / (TINY_VOCAB.vocab - TINY.vocab))
        return {
            "per_token_s": max(0.0, tiny - TINY.vocab * per_entry),
            "per_vocab_entry_s": per_entry,
            "measured_on": datetime.date.today().isoformat(),
        }

    def terms_of(self, kind: str, base: Mapping[str, float]) -> dict[str, float] | None:
        """share[kind] and per_layer[kind] from a deep and a wide model of that type, which read
        about as many bytes from memory in many layers and in few; None where quill cannot make
        weights of that type (quant/replica.py says which)."""
        from quant.gguf import GGUFError

        try:
            deep = replace(DEEP, weight_type=kind).deep_enough(wide_bytes())
            wide = replace(WIDE, weight_type=kind).deep_enough(wide_bytes())
            deep_s, wide_s = self.timed([(deep, 0), (wide, 0)])
        except (StopIteration, GGUFError, ValueError):  # ValueError: a type gguf cannot write
            return None
        call = base["per_token_s"] + deep.vocab * base["per_vocab_entry_s"]
        # (seconds - call) = bytes x s_per_byte + layers x per_layer, for each of the two.
        (b1, l1, t1), (b2, l2, t2) = (
            (model.weights_bytes, model.layers, seconds - call)
            for model, seconds in ((deep, deep_s), (wide, wide_s))
        )
        s_per_byte = (t1 * l2 - t2 * l1) / (b1 * l2 - b2 * l1)
        if s_per_byte <= 0:  # noise swamped the difference: the wide model's bytes alone
            s_per_byte = t2 / b2
        return {
            "share": 1 / (s_per_byte * self.bandwidth.gb_per_s * 1e9),
            "per_layer_s": max(0.0, (t1 - b1 * s_per_byte) / l1),
        }

    def attention_of(self, kv_type: str) -> float:
        """Seconds a cached position x layer x query head costs beyond reading its K and V: a
        small model's decode at ATTENTION_DEPTH against at 0, two loads of it in turns."""
        near, far = self.timed([(ATTENTION, 0), (ATTENTION, ATTENTION_DEPTH)], kv_type)
        head_dim = ATTENTION.width // ATTENTION.heads
        shape = ModelShape(
            "llama", ATTENTION.layers, (ATTENTION.kv_heads,) * ATTENTION.layers, head_dim,
            head_dim, ATTENTION.width, ATTENTION.vocab, 0, 0,
        )  # fmt: skip
        kv_bytes = kv_read_per_token(shape, ATTENTION_DEPTH, kv_type)
        computing = far - near - kv_bytes / (self.bandwidth.gb_per_s * 1e9)
        return max(0.0, computing / (ATTENTION_DEPTH * ATTENTION.layers * ATTENTION.heads))


def wide_bytes() -> int:
    """The weights of a wide or deep model: 4x the last-level caches, at least MIN_WIDE_BYTES
    (decode must read them from memory, not from the caches)."""
    caches = {}
    for folder in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index3"):
        with contextlib.suppress(OSError, ValueError):
            shared = (folder / "shared_cpu_list").read_text()
            caches[shared] = int((folder / "size").read_text().strip().removesuffix("K")) << 10
    return max(MIN_WIDE_BYTES, 4 * sum(caches.values()))


def cpu_seconds() -> tuple[float, float, float]:
    """(now, the seconds all CPUs have been busy, this process's CPU seconds), as
    cli/engine/freecores.py counts them (its window is at most 5 s: a calibration takes more)."""
    import psutil

    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    # guest time is already counted in user time on Linux.
    guest = getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    own = psutil.Process().cpu_times()
    return time.monotonic(), sum(times) - idle - guest, own.user + own.system


def busy_elsewhere(since: tuple[float, float, float]) -> float:
    """Cores' worth of CPU time other processes used since then."""
    now = cpu_seconds()
    others = (now[1] - since[1]) - (now[2] - since[2])
    return max(0.0, others) / max(now[0] - since[0], 1e-6)


Case = tuple[Synthetic, int]  # a model, and the positions in its cache while it decodes


def measure_synthetic(cases: Sequence[Case], threads: int, kv_type: str = "f16") -> list[float]:
    """Seconds a token of each case, the cases loaded together (each model's replica written to
    a temporary folder, gone after) and measured in turns: a warm-up round, then ROUNDS rounds
    of TOKENS each, a case's median counting. A shared machine's slow spells (here its read
    bandwidth moves by 20% from one second to the next) then fall on all the cases alike."""
    from cli.engine.opening import open_engine
    from cli.engine.options import LoadOptions
    from cli.engine.settings import ModelSettings

    scratch = quill_home() / "cache"
    scratch.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="calibration-", dir=scratch) as folder:
        paths = {model: write_synthetic(model, Path(folder)) for model in dict(cases)}
        with contextlib.ExitStack() as stack:
            turns = []
            for model, depth in cases:
                options = LoadOptions(
                    n_ctx=depth + TOKENS + 16,
                    n_batch=512,
                    threads=threads,
                    kv_type_k=kv_type,
                    kv_type_v=kv_type,
                )
                engine = stack.enter_context(open_engine(paths[model], options, ModelSettings()))
                turns.append(_Turns(engine, depth, rng))
            for _ in range(ROUNDS + 1):
                for turn in turns:
                    turn.decode()
            return [statistics.median(turn.seconds[1:]) for turn in turns]


class _Turns:
    """One case's rounds: TOKENS decoded after its depth's random tokens, which the engine's
    prefix cache keeps from round to round, as quill bench's tg rows decode them."""

    def __init__(self, engine: Any, depth: int, rng: random.Random) -> None:
        from cli.engine.sampling import SamplingParams

        self.engine, self.rng, self.seconds = engine, rng, list[float]()
        self.greedy = SamplingParams(temperature=0.0, ignore_eos=True)
        self.context = [rng.randrange(engine.n_vocab) for _ in range(depth)]
        if self.context:
            for _ in engine.stream_generate(self.context, 1, self.greedy):
                pass

    def decode(self) -> None:
        prompt = [*self.context, self.rng.randrange(self.engine.n_vocab)]
        events = list(self.engine.stream_generate(prompt, TOKENS + 1, self.greedy))
        self.seconds.append(1 / events[-1].decode_tokens_per_s)


def write_synthetic(model: Synthetic, folder: Path) -> Path:
    """model's replica in folder: its header written with the gguf package, its weights by
    quant/replica.py (GGUFError for a type it cannot make)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from quant.replica import write_replica

    header = folder / f"{model.name}.gguf.part"
    writer = GGUFWriter(str(header), "llama")
    writer.add_name(f"{model.name} ({MADE_FOR})")
    writer.add_context_length(4096)
    writer.add_embedding_length(model.width)
    writer.add_block_count(model.layers)
    writer.add_feed_forward_length(model.ffn)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_rope_dimension_count(model.width // model.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    _add_vocabulary(writer, model.vocab)
    kind, float32 = GGMLQuantizationType(type_id(model.weight_type)), np.dtype(np.float32)
    for name, rows, cols in model.tensors():
        if cols:
            size = model.tensor_bytes(rows, cols)
            writer.add_tensor_info(name, (rows, cols), float32, size, raw_dtype=kind)
        else:
            writer.add_tensor_info(name, (rows,), float32, rows * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    target = folder / f"{model.name}.gguf"
    write_replica(header.read_bytes(), target, MADE_FOR)
    header.unlink()
    return target


def _add_vocabulary(writer: Any, size: int) -> None:
    """A SentencePiece vocabulary of `size` tokens: unknown, BOS, EOS, the 256 bytes, fillers."""
    from gguf import TokenType

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    kinds = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    tokens += [f"\u2581t{n}" for n in range(size - len(tokens))]
    kinds += [TokenType.NORMAL] * (size - len(kinds))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * size)
    writer.add_token_types(kinds)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

"""The path table: for each weight type this CPU can repack (cli/engine/loading.py's
repack_layout), whether its matrices run faster repacked or plain, for prefill and for decode.

llama.cpp repacks every matrix it can at load, and that is not always the faster kernel: on a
Zen 4 machine Q4_K prefill ran 1.7x slower repacked while decode gained 4-10%; on an AVX2-only
EPYC both lost. So quill measures it. For each repackable type a model holds, a synthetic model
of that type (predict.py's wide shape, its weights 4x the last-level caches so that decode reads
them from memory) is loaded both ways at once, and the two take turns: a prefill of
PREFILL_TOKENS, then a decode of DECODE_TOKENS, ROUNDS times after a warm-up, the medians
counting. About 2-4 s a type. The table is kept in QUILL_HOME/paths.json under the CPU model,
llama.cpp's CPU features, the thread count and llama.cpp's build: when any changes, it is
measured again. A measurement beside other work is taken again, and one made while other
processes kept BUSY_SHARE of a core busy is used by this process and not kept.

The choice (choose): a load serves some work, P prompt tokens and G generated ones (Workload);
each type goes where P / prefill + G / decode, in seconds, is least. Repacking happens at load,
so it is one placement per load: `quill run` takes P from its prompt's length and G from its
--max-tokens, a chat turn and a server's request are typical ones (CHAT, SERVE).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cli.engine.freecores import BUSY_SHARE
from cli.engine.hardware import physical_cores
from cli.engine.options import LoadOptions
from cli.errors import QuillError
from cli.measure.predict import (
    AGAIN_BUSY,
    ATTEMPTS,
    WIDE,
    busy_elsewhere,
    calibration_key,
    cpu_seconds,
    read_cache,
    type_id,
    wide_bytes,
    write_synthetic,
)
from cli.store.home import quill_home
from quant.gguf import GGML_TYPES
from quant.partfiles import write_replacing

PLACEMENTS = ("repacked", "plain")
PREFILL_TOKENS, DECODE_TOKENS, ROUNDS = 256, 16, 3
# The weight types --paths shows: those models are made of (F16 and BF16 have no repacked
# layout on any CPU this build knows; they are listed to say so).
TABLE_TYPES = ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "Q2_K", "F16", "BF16")
CHARS_PER_TOKEN = 4  # a prompt's tokens, guessed before the model (and its tokenizer) is loaded
TEMPLATE_TOKENS = 16  # what a chat template adds around a one-shot prompt


@dataclass(frozen=True)
class Workload:
    """The work a load serves: what the choice weighs prefill and decode by."""

    what: str
    prompt_tokens: int
    generated_tokens: int

    @classmethod
    def of_run(cls, prompt: str, max_tokens: int) -> Workload:
        tokens = len(prompt.encode("utf-8")) // CHARS_PER_TOKEN + TEMPLATE_TOKENS
        return cls(f"a {tokens}-token prompt, up to {max_tokens} tokens out", tokens, max_tokens)


CHAT = Workload("a chat turn (256 tokens in, 256 out)", 256, 256)
# An agent's requests carry long system prompts and tools; the prefix cache takes some of it.
SERVE = Workload("a server's request (1,024 tokens in, 256 out)", 1024, 256)


@dataclass(frozen=True)
class TypePaths:
    """One weight type's speeds, each placement, on the synthetic model made of it."""

    weight_type: str  # quant/gguf.py's name, e.g. Q4_K
    layout: str  # the repacked layout, e.g. q4_K_8x8
    prefill_tokens_per_s: dict[str, float]  # placement -> tok/s
    decode_tokens_per_s: dict[str, float]

    def seconds(self, placement: str, work: Workload) -> float:
        return (
            work.prompt_tokens / self.prefill_tokens_per_s[placement]
            + work.generated_tokens / self.decode_tokens_per_s[placement]
        )

    def best(self, work: Workload) -> str:
        return min(PLACEMENTS, key=lambda placement: self.seconds(placement, work))

    def faster(self, kind: str) -> tuple[str, float]:
        """(placement, how many times faster than the other) for prefill or decode."""
        speeds = self.prefill_tokens_per_s if kind == "prefill" else self.decode_tokens_per_s
        first, second = sorted(PLACEMENTS, key=lambda placement: -speeds[placement])
        return first, speeds[first] / speeds[second]

    def as_dict(self) -> dict[str, Any]:
        return {
            "weight_type": self.weight_type,
            "layout": self.layout,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }

    @classmethod
    def from_dict(cls, known: dict[str, Any]) -> TypePaths:
        """ValueError (or KeyError, TypeError) for an entry that is not one: a speed that is not a
        positive finite number would divide by zero or choose nonsense."""
        prefill, decode = known["prefill_tokens_per_s"], known["decode_tokens_per_s"]
        speeds = [float(both[placement]) for both in (prefill, decode) for placement in PLACEMENTS]
        if not all(math.isfinite(speed) and speed > 0 for speed in speeds):
            raise ValueError(f"speeds out of range: {speeds}")
        return cls(
            str(known["weight_type"]),
            str(known["layout"]),
            dict(zip(PLACEMENTS, speeds[:2], strict=True)),
            dict(zip(PLACEMENTS, speeds[2:], strict=True)),
        )


@dataclass(frozen=True)
class PathTable:
    """The table for one thread count: measured types, and how long measuring took now."""

    threads: int
    key: str
    types: dict[str, TypePaths]
    seconds: float = 0.0  # measured in this call (0: all from the cache)
    busy_elsewhere: float = 0.0  # the most other processes took beside a kept measurement
    unmade: tuple[str, ...] = ()  # types quill cannot make a synthetic model of

    @property
    def kept(self) -> bool:
        return self.busy_elsewhere < BUSY_SHARE

    def describe(self) -> str:
        made = ", ".join(sorted(self.types)) or "no type"
        said = f"measured the repacked and plain kernels of {made} in {self.seconds:.1f} s"
        if not self.kept:
            said += f" beside other work ({self.busy_elsewhere:.1f} cores): used now, not kept"
        return said + " (once per CPU and build)"


@dataclass(frozen=True)
class PathChoice:
    """Where a load puts each repackable type's matrices, and why."""

    repacked: tuple[str, ...]
    plain: tuple[str, ...]
    why: str  # "the path table, for WORK", "repack on", ...

    @property
    def placement(self) -> tuple[tuple[str, str], ...]:
        """As LoadOptions.placement takes it."""
        placed = [(kind, "repacked") for kind in self.repacked]
        return tuple(sorted(placed + [(kind, "plain") for kind in self.plain]))


def choose(
    weight_types: Collection[str], table: PathTable | None, work: Workload, repack: str = "auto"
) -> PathChoice:
    """Each repackable type's placement: repack "on" or "off" for all, or ("auto") the table's
    faster one for work (a type the table lacks is repacked, as llama.cpp would)."""
    kinds = sorted(set(weight_types))
    if repack != "auto":
        on = repack == "on"
        everything = tuple(kinds)
        return PathChoice(everything if on else (), () if on else everything, f"repack {repack}")
    types = table.types if table else {}
    plain = [kind for kind in kinds if kind in types and types[kind].best(work) == "plain"]
    repacked = [kind for kind in kinds if kind not in plain]
    return PathChoice(tuple(repacked), tuple(plain), f"the path table, for {work.what}")


def repackable_types(type_names: Iterable[tuple[str, int]]) -> set[str]:
    """The types among (type name, rows) of a model's matmul weights that this CPU can repack."""
    from cli.engine.loading import cpu_backend_features, repack_layout

    features = cpu_backend_features()
    return {name for name, rows in type_names if repack_layout(type_id(name), rows, features)}


def model_repackable_types(path: Path) -> set[str]:
    """The types of the matrices in the model at path that this CPU can repack: those of the
    plan the loader would make (none where the header cannot be read)."""
    from cli.engine.loading import cpu_backend_features, repack_plan, tensor_infos

    infos = tensor_infos(path)
    plan = repack_plan(infos, cpu_backend_features())
    return {GGML_TYPES[info.ggml_type][0] for info in infos if info.name in plan}


# ---- the table: cached, measured where it lacks a type ----------------------------------------


def cache_path() -> Path:
    return quill_home() / "paths.json"


def table_key(threads: int) -> str:
    """calibration_key's CPU model, threads and build, and the CPU features llama.cpp found."""
    from cli.engine.loading import cpu_backend_features

    features = sorted(f"{name}={value}" for name, value in cpu_backend_features().items())
    digest = hashlib.sha256("|".join(features).encode()).hexdigest()[:8]
    return f"{calibration_key(threads)}, features {digest}"


# Measured beside busy processes, this process's: {(cache, key): {type: TypePaths}}.
_NOT_KEPT: dict[tuple[Path, str], dict[str, TypePaths]] = {}


def path_table(
    threads: int,
    weight_types: Collection[str],
    before: Callable[[list[str]], None] = lambda _missing: None,
) -> PathTable:
    """The table for threads holding these (repackable) types: from the cache, else measured
    now (the types it lacks, told to before first) and kept."""
    key, path = table_key(threads), cache_path()
    known = read_cache(path)
    entry = known.get(key)
    types: dict[str, TypePaths] = {}
    if isinstance(entry, dict):
        for kind, measured in entry.items():
            with contextlib.suppress(KeyError, TypeError, ValueError, AttributeError):
                types[kind] = TypePaths.from_dict(measured)
    types.update(_NOT_KEPT.get((path, key), {}))
    missing = sorted(set(weight_types) - set(types))
    if missing:
        before(missing)
    started, busy, unmade, fresh = time.monotonic(), 0.0, [], {}
    for kind in missing:
        try:
            measured, beside = measure_type(kind, threads)
        # A type quill cannot write a model of, a disk too full for it, a machine where llama.cpp
        # will not load it: that type is placed by llama.cpp's rule, and the run goes on.
        except (StopIteration, ValueError, OSError, QuillError):
            unmade.append(kind)
            continue
        types[kind] = fresh[kind] = measured
        busy = max(busy, beside)
    seconds = round(time.monotonic() - started, 2) if fresh else 0.0
    table = PathTable(threads, key, types, seconds, round(busy, 2), tuple(unmade))
    if fresh and table.kept:
        stored = {kind: measured.as_dict() for kind, measured in types.items()}
        known[key] = stored
        path.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(path, json.dumps(known, indent=1) + "\n")
    elif fresh:
        _NOT_KEPT.setdefault((path, key), {}).update(fresh)
    return table


def measure_type(weight_type: str, threads: int) -> tuple[TypePaths, float]:
    """weight_type's speeds both ways, and the cores other work took beside the measurement kept:
    taken again (ATTEMPTS in all at most, the quietest counting) beside AGAIN_BUSY of a core."""
    from cli.engine.loading import cpu_backend_features, repack_layout

    model = replace(WIDE, name=f"paths-{weight_type}", weight_type=weight_type)
    model = model.deep_enough(wide_bytes())
    layout = repack_layout(type_id(weight_type), model.width, cpu_backend_features())
    if layout is None:
        raise ValueError(f"{weight_type} has no repacked layout on this CPU")
    tries: list[tuple[float, dict[str, tuple[float, float]]]] = []
    scratch = quill_home() / "cache"
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="paths-", dir=scratch) as folder:
        synthetic = write_synthetic(model, Path(folder))
        while len(tries) < ATTEMPTS and (not tries or tries[-1][0] >= AGAIN_BUSY):
            since = cpu_seconds()
            speeds = _both_ways(synthetic, threads)
            tries.append((busy_elsewhere(since), speeds))
    beside, speeds = min(tries, key=lambda attempt: attempt[0])
    prefill = {placement: speeds[placement][0] for placement in PLACEMENTS}
    decode = {placement: speeds[placement][1] for placement in PLACEMENTS}
    return TypePaths(weight_type, layout, prefill, decode), beside


def _both_ways(path: Path, threads: int) -> dict[str, tuple[float, float]]:
    """{placement: (prefill tok/s, decode tok/s)}, the two loads measured in turns."""
    from cli.engine.opening import open_engine
    from cli.engine.options import LoadOptions
    from cli.engine.sampling import SamplingParams
    from cli.engine.settings import ModelSettings

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    samples: dict[str, list[tuple[float, float]]] = {placement: [] for placement in PLACEMENTS}
    with contextlib.ExitStack() as stack:
        engines = {}
        for placement in PLACEMENTS:
            options = LoadOptions(
                n_ctx=PREFILL_TOKENS + DECODE_TOKENS + 16,
                n_batch=PREFILL_TOKENS,
                threads=threads,
                repack=placement == "repacked",
            )
            engines[placement] = stack.enter_context(open_engine(path, options, ModelSettings()))
        for _ in range(ROUNDS + 1):  # the first round warms up
            for placement, engine in engines.items():
                prompt = [rng.randrange(engine.n_vocab) for _ in range(PREFILL_TOKENS)]
                events = list(engine.stream_generate(prompt, DECODE_TOKENS + 1, greedy))
                last = events[-1]
                samples[placement].append((last.prefill_tokens_per_s, last.decode_tokens_per_s))
    return {
        placement: (
            statistics.median(prefill for prefill, _ in rounds[1:]),
            statistics.median(decode for _, decode in rounds[1:]),
        )
        for placement, rounds in samples.items()
    }


def table_for_load(
    path: Path, threads: int, on_measure: Callable[[str], None]
) -> tuple[set[str], PathTable | None]:
    """(the model's repackable types, the table holding them), on_measure told before a
    measurement (so that it is never inside a timed one without a line on stderr) and after."""
    kinds = model_repackable_types(path)
    if not kinds:
        return kinds, None

    def before(missing: list[str]) -> None:
        on_measure(
            f"measuring this CPU's repacked and plain kernels for {', '.join(missing)} "
            "(once per CPU and build, a few seconds a type)"
        )

    table = path_table(threads, kinds, before)
    if table.seconds:
        on_measure(table.describe())
    return kinds, table


def placed(
    path: Path,
    options: LoadOptions,
    repack: str,
    work: Workload,
    on_measure: Callable[[str], None],
) -> LoadOptions:
    """options with each repackable weight type of the model at path placed: with repack "auto"
    where the table says this CPU runs it faster for work (measured first where the table lacks
    it, on_measure told), else all repacked ("on") or all plain ("off"). On a GPU, or with layers
    on RPC servers, llama.cpp's own rule: those weights are not the CPU's."""
    if options.gpu_layers != 0 or options.rpc:
        return replace(options, placement=())
    if repack == "auto" and options.repack:
        threads = options.threads or physical_cores()
        kinds, table = table_for_load(path, threads, on_measure)
        choice = choose(kinds, table, work)
    else:  # options.repack is False for "off" (load_options, quill bench)
        mode = "on" if options.repack else "off"
        choice = choose(model_repackable_types(path), None, work, mode)
    return replace(options, placement=choice.placement)

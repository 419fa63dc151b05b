"""Hostile GGUF headers: random and structured mutations of real ones (the tiny model's; SmolLM2's
in the slow tier) through every place quill reads a header: the reader and the memory plan (as
quill serve plans a model), `quill inspect` and `quill list`, and the replica's plan step (what
`quill bench --replica` checks before it writes). Each case ends in under 2 s and 200 MB of
memory, in success or one line: a GGUFError in process, exit code 5 (8: does not fit) from a
command; never another exception. The cases come from a fixed seed: a failure names its seed,
kind and index, and make_case(scan(MODEL), SEED, KIND, INDEX) makes that case again."""

from __future__ import annotations

import random
import re
import resource
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cli.app import app
from cli.commands.models import available_memory
from cli.engine.options import context_size
from cli.errors import EXIT_DOES_NOT_FIT, EXIT_MODEL_LOAD, QuillError
from cli.store.header import header_on_disk
from cli.store.models import Download, model_header, parse_model_name, record
from cli.store.registry import load_registry
from cli.store.replicas import check_memory
from quant.gguf import GGUFError
from quant.memory import ModelShape, largest_context, plan
from quant.replica import replica_bytes

SEED = 41
FAST_CASES_PER_KIND = 30  # x 10 kinds: the fast tier, a few seconds
# x 10 kinds. SmolLM2's header (a 49k-token vocabulary, its merges) costs some 50 ms a case, ten
# times the tiny model's: its cases add real arrays and a real tensor table to the mutations,
# which a few hundred cover, and 3000 of them took 170 s, a seventh of the whole suite. The seed
# is fixed, so a run repeats the same cases: 300 and 50 took 49 s, twice these (CI's budget).
SLOW_CASES_PER_KIND = {"tiny": 150, "smollm2": 25}
MAX_SECONDS = 2.0
MAX_BYTES = 200 * 2**20
MiB = 2**20

# GGUF value types: id -> struct format.
SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
UNSIGNED = {1: "B", 2: "H", 4: "I", 8: "Q"}
HUGE = (2**64 - 1, 2**63, 2**63 - 1, 2**62, 2**40, 2**32 + 1, 2**32 - 1, 2**31, 10**6, 100_000)
# The fields quill's readers use: mutated more often than the others.
USED = re.compile(
    r"general\.(architecture|name|file_type|alignment)|split\.|tokenizer\.(ggml\.(model|tokens)"
    r"|chat_template)|\.(block_count|embedding_length|context_length|attention\.(head_count"
    r"|head_count_kv|key_length|value_length|sliding_window))"
)


# --- a GGUF header's layout: where each field, string and tensor info is ---------------------


@dataclass
class Field:
    key: str
    start: int  # its key's length
    type_at: int  # its value type
    end: int
    kind: int
    value_at: int = 0  # a scalar's value; an array's item type
    count: int = 0  # an array's


@dataclass
class Tensor:
    start: int
    dims_at: int  # its number of dimensions, then each
    n_dims: int
    type_at: int
    offset_at: int


@dataclass
class Layout:
    """The test's own scan of a header (the gguf package's reader takes seconds on SmolLM2's
    tokenizer): byte offsets to mutate at."""

    header: bytes  # up to where tensor data starts
    size: int  # the file's
    fields: list[Field] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    strings: list[int] = field(default_factory=list)  # each string's length
    kv_end: int = 0

    @property
    def architecture(self) -> str:
        found = next(f for f in self.fields if f.key == "general.architecture")
        (length,) = struct.unpack_from("<Q", self.header, found.value_at)
        return self.header[found.value_at + 8 : found.value_at + 8 + length].decode()


def scan(path: Path) -> Layout:
    data = path.read_bytes()
    at = 24
    layout = Layout(b"", len(data))

    def string() -> str:
        nonlocal at
        layout.strings.append(at)
        (length,) = struct.unpack_from("<Q", data, at)
        at += 8 + length
        return data[at - length : at].decode()

    n_tensors, n_fields = struct.unpack_from("<QQ", data, 8)
    for _ in range(n_fields):
        start = at
        key = string()
        type_at = at
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        entry = Field(key, start, type_at, 0, kind, at)
        if kind == STRING:
            string()
        elif kind == ARRAY:
            item, entry.count = struct.unpack_from("<IQ", data, at)
            at += 12
            for index in range(entry.count):
                if item == STRING:
                    if index < 50:
                        string()
                    else:
                        at += 8 + struct.unpack_from("<Q", data, at)[0]
                else:
                    at += struct.calcsize(SCALARS[item])
        else:
            at += struct.calcsize(SCALARS[kind])
        entry.end = at
        layout.fields.append(entry)
    layout.kv_end = at
    for _ in range(n_tensors):
        start = at
        string()
        (n_dims,) = struct.unpack_from("<I", data, at)
        tensor = Tensor(start, at, n_dims, at + 4 + 8 * n_dims, at + 8 + 8 * n_dims)
        at = tensor.offset_at + 8
        layout.tensors.append(tensor)
    layout.header = data[: -(-at // 32) * 32]
    return layout


# --- mutations -----------------------------------------------------------------------------


def encode(kind: int, value: object) -> bytes:
    if kind == STRING:
        raw = value.encode() if isinstance(value, str) else value
        return struct.pack("<Q", len(raw)) + raw
    return struct.pack("<" + SCALARS[kind], value)


def array(item: int, values: list) -> bytes:
    return struct.pack("<IQ", item, len(values)) + b"".join(encode(item, v) for v in values)


def typed(kind: int, payload: bytes) -> bytes:
    return struct.pack("<I", kind) + payload


def patch(data: bytes, at: int, width: int, value: int) -> bytes:
    return (
        data[:at]
        + struct.pack("<" + UNSIGNED[width], value % 2 ** (8 * width))
        + data[at + width :]
    )


def extremes(width: int) -> list[int]:
    top = 2 ** (8 * width)
    return [0, 1, top - 1, top // 2, top // 2 - 1, 513, 100_000 % top, 65536 % top, 2**31 % top]


@dataclass
class Case:
    what: str
    header: bytes
    name: str = "fuzz.gguf"
    cut: bool = False  # the file ends with the header's bytes: no data after them
    extra: dict[str, bytes] = field(default_factory=dict)  # other files beside it (a split's)


def replaced(layout: Layout, entry: Field, value: bytes) -> bytes:
    data = layout.header
    return data[: entry.type_at] + value + data[entry.end :]


def added(layout: Layout, pairs: list[tuple[str, bytes]]) -> bytes:
    data = layout.header
    (n_fields,) = struct.unpack_from("<Q", data, 16)
    new = b"".join(encode(STRING, key) + value for key, value in pairs)
    data = patch(data, 16, 8, n_fields + len(pairs))
    return data[: layout.kv_end] + new + data[layout.kv_end :]


def pick_field(rng: random.Random, layout: Layout, kinds: set[int] | None = None) -> Field:
    fields = [f for f in layout.fields if kinds is None or f.kind in kinds]
    used = [f for f in fields if USED.search(f.key)]
    return rng.choice(used if used and rng.random() < 0.7 else fields)


def mutate_counts(rng: random.Random, layout: Layout) -> Case:
    at, name = rng.choice([(8, "tensor count"), (16, "field count")])
    (now,) = struct.unpack_from("<Q", layout.header, at)
    value = rng.choice([*HUGE, 0, now + 1, now - 1, now * 1000])
    return Case(f"{name} {now} -> {value}", patch(layout.header, at, 8, value))


def mutate_scalar(rng: random.Random, layout: Layout) -> Case:
    entry = pick_field(rng, layout, set(SCALARS) - {F32, F64, BOOL})
    width = struct.calcsize(SCALARS[entry.kind])
    value = rng.choice(extremes(width))
    return Case(f"{entry.key} -> {value}", patch(layout.header, entry.value_at, width, value))


RETYPES: list[tuple[str, bytes]] = [
    ("an empty string", typed(STRING, encode(STRING, ""))),
    ("the string '12'", typed(STRING, encode(STRING, "12"))),
    ("a string of 70,000 x", typed(STRING, encode(STRING, "x" * 70_000))),
    ("a float 1.5", typed(F32, encode(F32, 1.5))),
    ("a float64 -1e300", typed(F64, encode(F64, -1e300))),
    ("a float NaN", typed(F32, encode(F32, float("nan")))),
    ("true", typed(BOOL, encode(BOOL, True))),
    ("an i8 -1", typed(I8, encode(I8, -1))),
    ("an i32 -5", typed(I32, encode(I32, -5))),
    ("an i64 -2**63", typed(I64, encode(I64, -(2**63)))),
    ("a u64 2**64-1", typed(U64, encode(U64, 2**64 - 1))),
    ("an empty u32 array", typed(ARRAY, array(U32, []))),
    ("an empty string array", typed(ARRAY, array(STRING, []))),
    ("a u32 array of one 2**32-1", typed(ARRAY, array(U32, [2**32 - 1]))),
    ("a u32 array of 511 eights", typed(ARRAY, array(U32, [8] * 511))),
    ("a u32 array of 513 ones", typed(ARRAY, array(U32, [1] * 513))),
    ("a u32 array of 5,000 zeros", typed(ARRAY, array(U32, [0] * 5000))),
    ("an i8 array of -1", typed(ARRAY, array(I8, [-1, -1]))),
    ("a bool array", typed(ARRAY, array(BOOL, [True, False]))),
    ("a float array", typed(ARRAY, array(F32, [0.5, 2.0]))),
    ("a string array", typed(ARRAY, array(STRING, ["a", "b"]))),
    ("an array of arrays", typed(ARRAY, struct.pack("<IQ", ARRAY, 1) + array(U32, [1]))),
    ("an array of type 99", typed(ARRAY, struct.pack("<IQ", 99, 1) + bytes(8))),
    ("value type 13", typed(13, bytes(8))),
    ("value type 2**32-1", typed(2**32 - 1, bytes(8))),
]


def mutate_type(rng: random.Random, layout: Layout) -> Case:
    entry = pick_field(rng, layout)
    what, value = rng.choice(RETYPES)
    if entry.kind == ARRAY and rng.random() < 0.3:  # a per-layer array of the wrong length
        n = rng.choice([0, 1, 3, 512, 513])
        what, value = f"a u32 array of {n}", typed(ARRAY, array(U32, [rng.choice([0, 1, 8])] * n))
    return Case(f"{entry.key} -> {what}", replaced(layout, entry, value))


def mutate_added(rng: random.Random, layout: Layout) -> Case:
    arch = layout.architecture
    u32 = rng.choice(extremes(4))
    window = f"{arch}.attention.sliding_window"
    pattern_length = rng.choice([0, 1, 2, 30, 512, 513, 5000])
    choices: list[tuple[str, list[tuple[str, bytes]], str]] = [
        (
            "split.count u16",
            [("split.count", typed(U16, encode(U16, rng.choice([2, 3, 65535]))))],
            "",
        ),
        ("split.count u32", [("split.count", typed(U32, encode(U32, u32)))], ""),
        ("split.count i32 -1", [("split.count", typed(I32, encode(I32, -1)))], ""),
        ("split.count '2'", [("split.count", typed(STRING, encode(STRING, "2")))], ""),
        (
            "split.count 2, split.no",
            [
                ("split.count", typed(U16, encode(U16, 2))),
                ("split.no", typed(U16, encode(U16, rng.choice([0, 1, 65535])))),
                ("split.tensors.count", typed(U32, encode(U32, rng.choice([0, 1, 2**32 - 1])))),
            ],
            "split",
        ),
        (
            "split.count 3, split.tensors.count as a string",
            [
                ("split.count", typed(U16, encode(U16, 3))),
                ("split.tensors.count", typed(STRING, encode(STRING, "many"))),
            ],
            "split",
        ),
        ("general.alignment", [("general.alignment", typed(U32, encode(U32, u32)))], ""),
        ("general.alignment u64", [("general.alignment", typed(U64, encode(U64, 64)))], ""),
        (
            "general.alignment '32'",
            [("general.alignment", typed(STRING, encode(STRING, "32")))],
            "",
        ),
        ("general.alignment -32", [("general.alignment", typed(I32, encode(I32, -32)))], ""),
        (
            f"sliding window {u32}, a pattern of {pattern_length}",
            [
                (window, typed(U32, encode(U32, u32))),
                (f"{window}_pattern", typed(ARRAY, array(BOOL, [True] * pattern_length))),
            ],
            "",
        ),
        (
            "sliding window 512, pattern as a number",
            [
                (window, typed(U32, encode(U32, 512))),
                (f"{window}_pattern", typed(U32, encode(U32, rng.choice([0, 6, 2**32 - 1])))),
            ],
            "",
        ),
        (
            "sliding window 512, pattern of strings",
            [
                (window, typed(U32, encode(U32, 512))),
                (f"{window}_pattern", typed(ARRAY, array(STRING, ["yes"] * 2))),
            ],
            "",
        ),
        ("sliding window as a string", [(window, typed(STRING, encode(STRING, "wide")))], ""),
        (
            f"key and value length {u32}",
            [
                (f"{arch}.attention.key_length", typed(U32, encode(U32, u32))),
                (f"{arch}.attention.value_length", typed(U32, encode(U32, u32))),
            ],
            "",
        ),
        ("expert count", [(f"{arch}.expert_count", typed(U32, encode(U32, u32)))], ""),
        ("general.name again", [("general.name", typed(STRING, encode(STRING, "twice")))], ""),
        ("an empty key", [("", typed(U32, encode(U32, 1)))], ""),
    ]
    what, pairs, split = rng.choice(choices)
    if rng.random() < 0.2:  # the same, for an architecture with sliding-window layers
        pairs = [(k.replace(arch, "gemma3"), v) for k, v in pairs]
        pairs += [
            ("gemma3.block_count", typed(U32, encode(U32, rng.choice([1, 26, 512, 513, u32])))),
            ("gemma3.attention.sliding_window", typed(U32, encode(U32, 512))),
        ]
        entry = next(f for f in layout.fields if f.key == "general.architecture")
        data = added(layout, pairs)  # after general.architecture: its offsets hold
        gemma = typed(STRING, encode(STRING, "gemma3"))
        return Case(f"gemma3: {what}", data[: entry.type_at] + gemma + data[entry.end :])
    data = added(layout, pairs)
    if split:  # named as a split's first file, its second beside it
        second = {"fuzz-00002-of-00002.gguf": data}
        return Case(f"added {what}", data, "fuzz-00001-of-00002.gguf", extra=second)
    return Case(f"added {what}", data)


def mutate_tensor(rng: random.Random, layout: Layout) -> Case:
    index = rng.randrange(len(layout.tensors))
    tensor, data = layout.tensors[index], layout.header
    part = rng.choice(["dims", "dim", "type", "name", "offset"])
    if part == "dims":
        value = rng.choice([5, 8, 64, 2**32 - 1, 0])
        return Case(
            f"tensor {index} with {value} dimensions", patch(data, tensor.dims_at, 4, value)
        )
    if part == "dim" and tensor.n_dims:
        which = rng.randrange(tensor.n_dims)
        value = rng.choice([2**64 - 1, 2**63, 2**62, 2**40, 2**33, 0, 1, 3])
        at = tensor.dims_at + 4 + 8 * which
        return Case(f"tensor {index} dimension {which} -> {value}", patch(data, at, 8, value))
    if part == "type":
        value = rng.choice([4, 5, 31, 36, 42, 43, 255, 2**32 - 1, rng.randrange(43)])
        return Case(f"tensor {index} of type {value}", patch(data, tensor.type_at, 4, value))
    if part == "name":
        value = rng.choice([2**64 - 1, 2**32, 64, 63, 0])
        return Case(f"tensor {index} name length {value}", patch(data, tensor.start, 8, value))
    value = rng.choice([2**64 - 1, 2**63, 2**40, 1, 31])
    return Case(f"tensor {index} at offset {value}", patch(data, tensor.offset_at, 8, value))


def mutate_string(rng: random.Random, layout: Layout) -> Case:
    at = rng.choice(layout.strings)
    remaining = layout.size - at - 8
    value = rng.choice([2**64 - 1, 2**63, 2**40, remaining, remaining + 1, 16 * MiB + 1, 0])
    return Case(f"the string at byte {at} of length {value}", patch(layout.header, at, 8, value))


def mutate_array(rng: random.Random, layout: Layout) -> Case:
    entry = pick_field(rng, layout, {ARRAY})
    value = rng.choice([2**64 - 1, 2**63, 2**40, 2**32, 0, 1, 4097, 5000, entry.count * 1000])
    at = entry.value_at + 4
    return Case(f"{entry.key} of {value} items", patch(layout.header, at, 8, value))


def mutate_cut(rng: random.Random, layout: Layout) -> Case:
    end = rng.choice([rng.randrange(len(layout.header)), rng.randrange(24), len(layout.header)])
    return Case(f"cut at byte {end}", layout.header[:end], cut=True)


def mutate_bytes(rng: random.Random, layout: Layout) -> Case:
    data = bytearray(layout.header)
    spots = sorted(rng.randrange(len(data)) for _ in range(rng.randint(1, 16)))
    for at in spots:
        data[at] = rng.randrange(256)
    return Case(f"random bytes at {spots}", bytes(data))


KINDS: dict[str, Callable[[random.Random, Layout], Case]] = {
    "counts": mutate_counts,
    "scalar": mutate_scalar,
    "type": mutate_type,
    "added": mutate_added,
    "tensor": mutate_tensor,
    "string": mutate_string,
    "array": mutate_array,
    "cut": mutate_cut,
    "bytes": mutate_bytes,
    "two": lambda rng, layout: mutate_two(rng, layout),
}


def mutate_two(rng: random.Random, layout: Layout) -> Case:
    """Two in-place mutations (same length: the second's offsets still hold)."""
    first = rng.choice([mutate_scalar, mutate_array, mutate_tensor, mutate_string])(rng, layout)
    again = Layout(first.header, layout.size, layout.fields, layout.tensors, layout.strings)
    again.kv_end = layout.kv_end
    second = rng.choice([mutate_scalar, mutate_counts, mutate_bytes])(rng, again)
    return Case(f"{first.what}; {second.what}", second.header)


def make_case(layout: Layout, seed: int, kind: str, index: int) -> Case:
    return KINDS[kind](random.Random(f"{seed}:{kind}:{index}"), layout)


# --- the places a header is read -----------------------------------------------------------


def write_case(case: Case, layout: Layout, folder: Path) -> Path:
    """The case as files: its header, then the source's data section as a hole (sparse: no
    bytes written), 32 bytes longer so that a field added does not cut the last tensor."""
    for path in folder.glob("*.gguf"):
        path.unlink()
    data_bytes = 0 if case.cut else layout.size - len(layout.header) + 32
    for name, header in {case.name: case.header, **case.extra}.items():
        with (folder / name).open("wb") as file:
            file.write(header)
            file.truncate(len(header) + data_bytes)
    return folder / case.name


def refused_in_one_line(error: BaseException) -> str:
    line = str(error)
    assert line and "\n" not in line, f"not one line: {line!r}"
    return line


def through_the_reader_and_plans(path: Path) -> str:
    """What quill serve and inspect do in process: the header, the facts, the memory plan."""
    try:
        model = header_on_disk(path)
        model.info.as_dict()
        shape = model.shape
        memory = plan(shape, context_size(None, shape.trained_ctx), "q8_0", parked_bytes=MiB)
        largest_context(shape, 8 * 2**30)
        served = ModelShape.from_gguf(path)  # ServeCatalog.memory_bytes
        plan(served, context_size(None, served.trained_ctx) * 4, "f16", "q4_0")
    except (GGUFError, QuillError) as error:
        assert not isinstance(error, QuillError) or error.exit_code == EXIT_MODEL_LOAD, error
        return "refused: " + refused_in_one_line(error)
    return f"ok: {memory.total_bytes}"


def through_the_replica_plan(path: Path) -> str:
    """quill bench --replica before it writes: the header with its bytes, the plan against this
    machine's memory, the replica's size."""
    try:
        model = model_header(parse_model_name(str(path), load_registry()), prefixes=True)
        plans = [plan(model.shape, 1024, kv) for kv in ("f16", "q8_0")]
        check_memory("fuzz", max(plans, key=lambda p: p.total_bytes), available_memory())
        for prefix in model.prefixes:
            replica_bytes(prefix, "fuzz")
        assert model.names[0] == path.name
    except (GGUFError, QuillError) as error:
        codes = (EXIT_MODEL_LOAD, EXIT_DOES_NOT_FIT)
        assert not isinstance(error, QuillError) or error.exit_code in codes, error
        return "refused: " + refused_in_one_line(error)
    return "ok"


def through_inspect(runner, path: Path) -> str:
    result = runner.invoke(app, ["inspect", str(path)])
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        return "ok"
    assert result.exit_code == EXIT_MODEL_LOAD, (result.exit_code, result.output, result.exception)
    assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
    return "refused: " + result.stderr.strip()


def through_list(runner, path: Path, home: Path, good: Path) -> str:
    """The case beside a sound model in the manifest: both listed, the case's row says what it
    is or that it is unreadable."""
    for name, each in (("fuzz", path), ("good", good)):
        record(home, Download(str(each), name, "quantize", None, each.name, 0, None, 0.0))
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0 and "Traceback" not in result.output, (
        result.output,
        result.exception,
    )
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "good" in rows and "fuzz" in rows, result.stdout
    return rows["fuzz"]


def peak_tracker() -> Callable[[], int]:
    """The bytes this process's resident set grew by since the call, at its peak: the kernel's
    peak is reset where Linux allows it (clear_refs), else the growth of the lifetime peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        status = Path("/proc/self/status")
        start = int(re.search(r"VmRSS:\s+(\d+)", status.read_text())[1])
        return lambda: (int(re.search(r"VmHWM:\s+(\d+)", status.read_text())[1]) - start) * 1024
    except (OSError, TypeError):
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return lambda: (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) * 1024


@dataclass
class Fuzz:
    folder: Path
    home: Path
    good: Path
    runner: object
    outcomes: dict[str, int] = field(default_factory=dict)

    def run(self, layout: Layout, seed: int, kind: str, index: int, clis: bool) -> None:
        case = make_case(layout, seed, kind, index)
        where = f"seed {seed}, case {kind} {index} ({case.what})"
        path = write_case(case, layout, self.folder)
        # CPU time, not the wall's: the work a case costs, the same on cores other work keeps busy
        peak, start = peak_tracker(), time.process_time()
        try:
            results = [through_the_reader_and_plans(path), through_the_replica_plan(path)]
            if clis:
                results += [through_inspect(self.runner, path)]
                results += [through_list(self.runner, path, self.home, self.good)]
        except Exception as error:  # what the case did: named with the case
            raise AssertionError(f"{where}: {type(error).__name__}: {error}") from error
        took, grew = time.process_time() - start, peak()
        assert took < MAX_SECONDS, f"{where}: took {took:.1f} s"
        assert grew < MAX_BYTES, f"{where}: memory grew by {grew / MiB:.0f} MiB"
        outcome = results[0].partition(":")[0]
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


@pytest.fixture
def fuzz(tmp_path, monkeypatch, runner, tiny_path) -> Fuzz:
    home = tmp_path / "home"
    monkeypatch.setenv("QUILL_HOME", str(home))
    folder = tmp_path / "case"
    folder.mkdir()
    good = tmp_path / "good.gguf"
    good.write_bytes(tiny_path.read_bytes())
    return Fuzz(folder, home, good, runner)


def check_sound(fuzz: Fuzz, source: Path) -> Layout:
    """The unmutated header passes everything: the harness itself reads a sound model."""
    layout = scan(source)
    sound = Case("none", layout.header)
    path = write_case(sound, layout, fuzz.folder)
    assert through_the_reader_and_plans(path).startswith("ok")
    assert through_the_replica_plan(path) == "ok"
    assert through_inspect(fuzz.runner, path) == "ok"
    assert "unreadable" not in through_list(fuzz.runner, path, fuzz.home, fuzz.good)
    return layout


@pytest.mark.parametrize("kind", KINDS)
def test_mutated_tiny_headers_end_in_one_line_or_success(fuzz, tiny_path, kind):
    layout = check_sound(fuzz, tiny_path)
    for index in range(FAST_CASES_PER_KIND):
        fuzz.run(layout, SEED, kind, index, clis=index % 3 == 0)
    assert sum(fuzz.outcomes.values()) == FAST_CASES_PER_KIND


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_many_mutated_headers_end_in_one_line_or_success(fuzz, request, model):
    source = request.getfixturevalue("tiny_path" if model == "tiny" else "smollm2_path")
    layout = check_sound(fuzz, source)
    for kind in KINDS:
        for index in range(SLOW_CASES_PER_KIND[model]):
            fuzz.run(layout, SEED + 1, kind, index, clis=index % 4 == 0)
    assert fuzz.outcomes.get("ok") and fuzz.outcomes.get("refused")

"""Generated JSON Schemas and GBNF grammars (sizes, bounds from 0 to 10^12, repetition,
character classes, refs) sent to a running `quill serve` and to `quill run`, each process under a
memory limit: what tests/test_fuzz_grammar.py runs a short round of, and benchmarks/fuzz_grammar.py
(`python -m benchmarks.fuzz_grammar`) the long mode."""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

QUILL = str(Path(sys.executable).with_name("quill"))
MEMORY_LIMIT = 3 << 30  # address space each quill process may have
RSS_BOUND = 1536 << 20  # peak RSS the server may reach (tiny model: ~200 MB)


# --- generated cases ---------------------------------------------------------------------------

_BOUNDS = [0, 1, 2, 15, 64, 65, 100, 1999, 2000, 2001, 5000, 30000, 100000, 10**9, 10**12]


def _bound(rng: random.Random) -> int:
    return rng.choice(_BOUNDS) if rng.random() < 0.7 else rng.randrange(0, 50000)


def _char_class(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.15:
        return "[^\\x00-\\U0010FFFF]"  # matches nothing
    if pick < 0.25:
        return "[]"
    if pick < 0.35:
        return "[z-a]"
    ranges = []
    for _ in range(rng.randint(1, 4)):
        low = rng.choice([0x20, 0x30, 0x41, 0x61, 0xE9, 0x4E00, 0x1F600])
        high = low + rng.choice([0, 1, 9, 25, 1000])
        ranges.append(f"\\U{low:08X}-\\U{high:08X}" if high != low else f"\\U{low:08X}")
    return "[" + ("^" if rng.random() < 0.3 else "") + "".join(ranges) + "]"


def _item(rng: random.Random, depth: int, rules: list[str]) -> str:
    pick = rng.random()
    if depth > 3 or pick < 0.3:
        return json.dumps(rng.choice(["a", "yes", "", "\u00e9", "x" * rng.randint(1, 300)]))
    if pick < 0.5:
        return _char_class(rng)
    if pick < 0.65:
        return rng.choice(rules)
    if pick < 0.75:
        return "."
    if pick < 0.85:
        return "(" * (n := rng.choice([1, 2, 50, 150, 3000])) + '"g"' + ")" * n
    alternatives = [_sequence(rng, depth + 1, rules) for _ in range(rng.randint(1, 3))]
    return "(" + " | ".join(alternatives) + ")"


def _repeat(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.4:
        return ""
    if pick < 0.55:
        return rng.choice(["*", "+", "?"])
    low, high = _bound(rng), _bound(rng)
    return rng.choice([f"{{{low}}}", f"{{{low},}}", f"{{{low},{high}}}", f"{{0,{high}}}"])


def _sequence(rng: random.Random, depth: int, rules: list[str]) -> str:
    return " ".join(_item(rng, depth, rules) + _repeat(rng) for _ in range(rng.randint(1, 4)))


def random_grammar(rng: random.Random) -> str:
    names = ["root"] + [f"r{i}" for i in range(rng.randint(0, 4))]
    lines = []
    for name in names:
        alternatives = [_sequence(rng, 0, names) for _ in range(rng.randint(1, 3))]
        lines.append(f"{name} ::= " + " | ".join(alternatives))
    if rng.random() < 0.1:  # a long chain of rules
        n = rng.choice([100, 5000, 30000])
        lines.append("root ::= c0")
        lines.extend(f"c{i} ::= c{i + 1}" for i in range(n))
        lines.append(f'c{n} ::= "end"')
    return "\n".join(lines)


def _schema(rng: random.Random, depth: int = 0) -> dict:
    pick = rng.random()
    if depth > 3 or pick < 0.3:
        schema: dict = {"type": "string"}
        for key in ("minLength", "maxLength"):
            if rng.random() < 0.5:
                schema[key] = _bound(rng)
        if rng.random() < 0.2:
            schema = {"type": "string", "pattern": f"^[a-z]{{{_bound(rng)},{_bound(rng)}}}$"}
        return schema
    if pick < 0.45:
        return {"type": "integer", "minimum": -_bound(rng), "maximum": _bound(rng)}
    if pick < 0.6:
        schema = {"type": "array", "items": _schema(rng, depth + 1)}
        for key in ("minItems", "maxItems"):
            if rng.random() < 0.5:
                schema[key] = _bound(rng)
        return schema
    if pick < 0.7:
        return {"anyOf": [_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if pick < 0.8:
        return {"$ref": "#/$defs/node"} if depth else {
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node",
        }  # fmt: skip
    properties = {f"p{i}": _schema(rng, depth + 1) for i in range(rng.randint(1, 6))}
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if rng.random() < 0.5],
    }


def random_body(rng: random.Random) -> dict:
    """A chat request constraining its reply one of the ways quill takes."""
    pick = rng.random()
    body: dict = {"messages": [{"role": "user", "content": "Say"}], "max_tokens": 8,
                  "seed": rng.randrange(1000)}  # fmt: skip
    if pick < 0.4:
        body["grammar"] = random_grammar(rng)
    elif pick < 0.8:
        spec = {"name": "s", "schema": _schema(rng)}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    else:
        parameters = {"type": "object", "properties": {"a": _schema(rng)}, "required": ["a"]}
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
        body["tool_choice"] = "required"
    return body


# --- running them -----------------------------------------------------------------------------


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def rss_bytes(pid: int) -> int:
    """Peak RSS (VmHWM) of a live process, 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class FuzzReport:
    cases: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    slowest_s: float = 0.0
    slowest: str = ""
    peak_rss: int = 0
    failures: list[str] = field(default_factory=list)


def start_server(model: Path, env: dict[str, str], workdir: Path) -> tuple[subprocess.Popen, str]:
    ready = workdir / f"port-{time.monotonic_ns()}"
    process = subprocess.Popen(
        [QUILL, "serve", "-m", str(model), "--port", "0", "--parallel", "2", "--ctx", "512",
         "--threads", "1"],
        env={**env, "QUILL_SERVE_READY_FILE": str(ready)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_limited,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.exists() or not ready.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("quill serve did not start")
        time.sleep(0.1)
    return process, f"http://127.0.0.1:{ready.read_text()}"


def fuzz_server(
    url: str, process: subprocess.Popen, cases: int, seed: int, budget_s: float
) -> FuzzReport:
    """Send cases generated bodies; stop at the first case that kills or stalls the server."""
    rng = random.Random(seed)
    report = FuzzReport()
    started = time.monotonic()
    for index in range(cases):
        if time.monotonic() - started > budget_s:
            break
        body = random_body(rng)
        shown = json.dumps(body)[:300]
        began = time.monotonic()
        try:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            status = response.status_code
        except httpx.HTTPError as error:
            status = -1
            report.failures.append(f"case {index}: no answer ({type(error).__name__}): {shown}")
        took = time.monotonic() - began
        report.cases += 1
        report.statuses[status] = report.statuses.get(status, 0) + 1
        if took > report.slowest_s:
            report.slowest_s, report.slowest = took, shown
        report.peak_rss = max(report.peak_rss, rss_bytes(process.pid))
        if status >= 500:
            report.failures.append(f"case {index}: HTTP {status}: {shown}")
        if process.poll() is not None:
            report.failures.append(f"case {index}: the server died ({process.returncode}): {shown}")
            break
        if report.peak_rss > RSS_BOUND:
            report.failures.append(f"case {index}: RSS {report.peak_rss >> 20} MiB: {shown}")
            break
        if status == -1:
            break
    return report


def fuzz_cli(
    model: Path, env: dict[str, str], cases: int, seed: int, budget_s: float
) -> FuzzReport:
    """quill run with generated --schema and --grammar values: exit 0, 2 or 7, never a signal
    or a traceback, and nothing on stdout when refused."""
    rng = random.Random(seed)
    report = FuzzReport()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as folder:
        grammar_file = Path(folder) / "g.gbnf"
        for index in range(cases):
            if time.monotonic() - started > budget_s:
                break
            if rng.random() < 0.5:
                grammar_file.write_text(random_grammar(rng))
                args = ["--grammar", str(grammar_file)]
                shown = grammar_file.read_text()[:300]
            else:
                args = ["--schema", json.dumps(_schema(rng))]
                shown = args[1][:300]
            began = time.monotonic()
            try:
                done = subprocess.run(
                    [QUILL, "run", "-m", str(model), *args, "--max-tokens", "8", "--no-stats",
                     "Say"],
                    env=env, capture_output=True, text=True, timeout=120, preexec_fn=_limited,
                )  # fmt: skip
                code, out, err = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired:
                code, out, err = -999, "", "timed out"
            took = time.monotonic() - began
            report.cases += 1
            report.statuses[code] = report.statuses.get(code, 0) + 1
            if took > report.slowest_s:
                report.slowest_s, report.slowest = took, shown
            if code not in (0, 2, 7) or "Traceback" in err or (code == 2 and out):
                report.failures.append(f"case {index}: exit {code} {err[-300:]!r}: {shown}")
    return report

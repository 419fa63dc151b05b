"""quill's embeddings against llama.cpp's own tools built from the same sdist: `quill embed`
against `llama-embedding`, and `quill serve` against `llama-server --embeddings`, on the same
model, machine and threads.

Usage (inside quill's venv; the machine otherwise idle):
  python -m benchmarks.embed --model PATH.gguf [--rounds 5] [--threads 2] [--short 1000]
      [--long 200] [--long-tokens 400] [--clients 4] [--per-request 16] [--long-per-request 8]
      [--tests "embed short" ...] [--quiet-wait 30] [--json FILE]

The texts are generated (seeded, so every run embeds the same ones): --short English-ish
sentences of about 10-20 tokens and --long passages of about --long-tokens tokens (under the
model's 512), counted by the model's own tokenizer. Five tests, each a pair of contenders:

  embed short, embed long: `quill embed MODEL --batch B --threads T --no-stats`, one text
      a line on stdin, against `llama-embedding -m MODEL -f FILE --embd-normalize 2
      --embd-output-format json -t T -b B -ub B` (it splits the prompt on newlines; --batch B,
      default 512, quill embed's own default on MiniLM; llama-embedding's is 2048);
      vectors to a file; the whole process's wall time (Python's start and the model's load
      included) and CPU seconds; llama-embedding's load is its log's timestamp at system_info
  embed one: one text as an argument (quill with its stats line, whose "load X s" is the
      model's load; llama-embedding with -p): the fixed cost of a run
  serve short, serve long: `quill serve MODEL --threads T` against `llama-server -m MODEL
      --embeddings -t T`, their defaults otherwise (both decode 512 tokens at a time, which
      every input here fits), started for each measurement and warmed up with one request
      (neither timed); --clients threads each POST /v1/embeddings with --per-request texts
      (--long-per-request long ones), back to back, until all texts are embedded; texts/s over
      the clients' wall time, and the server's CPU seconds meanwhile

Every round runs each test once, its two contenders one after the other (harness.py's
interleave: each measurement waits for a quiet machine, at most --quiet-wait s, and who goes
first turns each round). Every run's rows are counted (each text embedded once). The first
round's vectors are compared: min cosine over all texts of quill embed's against
llama-embedding's and quill serve's against llama-server's. The ratio is quill's texts/s over
llama.cpp's, per round (the paired median, its range, and the quiet pairs' median). Writes
--json and a .md beside it with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from importlib.metadata import version
from pathlib import Path

import httpx2 as httpx
import numpy as np
import psutil

from benchmarks.harness import (
    QUIET,
    QUILL,
    RESULTS,
    TOOLS,
    add_quiet_wait,
    command_line,
    in_threads,
    interleave,
    machine_line,
    paired,
    quill_commit,
    refuse_omp_wait_policy,
    served_model,
    serving,
    users_env,
)

TARGET = 0.95
BATCH = 512  # tokens per decode, both tools (--batch): quill embed's default on MiniLM

SUBJECTS = [
    "the old fisherman", "a young teacher", "our neighbor", "the city council", "every student",
    "the small robot", "a tired doctor", "the museum guide", "my grandmother", "the night nurse",
    "a quiet engineer", "the baker's son", "two hikers", "the new manager", "a famous painter",
    "the village choir", "an old sailor", "the chess club", "a curious child", "the head chef",
]  # fmt: skip
VERBS = [
    "repaired", "painted", "described", "forgot", "carried", "studied", "sold", "found",
    "measured", "cleaned", "photographed", "borrowed", "ignored", "delivered", "explained",
    "rebuilt", "counted", "translated", "hid", "praised",
]  # fmt: skip
OBJECTS = [
    "a wooden boat", "the broken clock", "three green apples", "an ancient map",
    "the garden wall", "a letter from Lisbon", "the heavy piano", "a basket of bread",
    "the station's timetable", "a red bicycle", "the last chapter", "an empty bottle",
    "the winter coats", "a stack of old newspapers", "the school's roof", "a silver key",
]  # fmt: skip
PLACES = [
    "near the harbor", "before sunrise", "in the quiet library", "after the storm",
    "on a rainy Tuesday", "behind the station", "at the edge of town", "during the festival",
    "in the crowded market", "under the bridge", "late in the evening", "beside the river",
]  # fmt: skip
ENDINGS = [
    "", "", "", " without saying a word", " for the second time", " while the children watched",
    " because nobody else would", " and then went home", " as the bells rang", " twice",
]  # fmt: skip


# --- the texts ----------------------------------------------------------------------------------


def sentence(rng: random.Random) -> str:
    words = (f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
             f"{rng.choice(PLACES)}{rng.choice(ENDINGS)}.")  # fmt: skip
    return words[0].upper() + words[1:]


def make_texts(model: Path, short: int, long: int, long_tokens: int) -> dict:
    """{"short": [...], "long": [...], "tokens": {set: [each text's tokens]}}: seeded texts,
    counted by the model's tokenizer ([CLS] and [SEP] included)."""
    from cli.engine.embedding import Embedder
    from cli.engine.options import LoadOptions

    rng = random.Random(2026_12_03)
    with Embedder(model, LoadOptions(threads=1)) as embedder:
        shorts = [sentence(rng) for _ in range(short)]
        longs = []
        for _ in range(long):
            target, text = rng.randint(long_tokens - 20, long_tokens + 20), sentence(rng)
            while True:
                more = f"{text} {sentence(rng)}"
                if len(embedder.tokenize(more)) > min(target, embedder.n_ctx):
                    break
                text = more
            longs.append(text)
        tokens = {
            name: [len(embedder.tokenize(t)) for t in texts]
            for name, texts in (("short", shorts), ("long", longs))
        }
    return {"short": shorts, "long": longs, "tokens": tokens}


# --- the command-line tools ---------------------------------------------------------------------


def timed(
    command: Sequence[str], stdin: Path | None, stdout: Path, env: dict
) -> tuple[float, float, str]:
    """(wall seconds from start to exit, the CPU seconds it used, what it said on stderr);
    SystemExit if it failed."""
    with (
        open(stdin or "/dev/null", "rb") as source,
        open(stdout, "wb") as sink,
        tempfile.TemporaryFile() as said,
    ):
        started = time.perf_counter()
        process = subprocess.Popen(command, stdin=source, stdout=sink, stderr=said, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        said.seek(0)
        text = said.read().decode("utf-8", "replace")
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))[:300]} failed: {text[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, text


def quill_vectors(output: Path) -> np.ndarray:
    rows = [json.loads(line)["vector"] for line in output.read_text().splitlines() if line]
    return np.array(rows, dtype=np.float64)


def llama_vectors(output: Path) -> np.ndarray:
    rows = json.loads(output.read_text())["data"]
    return np.array([row["embedding"] for row in rows], dtype=np.float64)


def llama_load_s(said: str) -> float:
    """llama-embedding's log timestamp (minutes.seconds.ms.us since its log began) at the
    system_info line: the model loaded and the context made, no text tokenized yet."""
    found = re.search(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I system_info", said, re.MULTILINE)
    if not found:
        return float("nan")
    minutes, seconds, ms, us = (int(x) for x in found.groups())
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def decodes(said: str) -> list[int]:
    """llama-embedding's tokens per decode, from its batch_decode log lines."""
    return [int(n) for n in re.findall(r"batch_decode: n_tokens = (\d+)", said)]


class Tools:
    """quill embed and llama-embedding on one set of texts (short, long, or one text as an
    argument): the contenders of a test."""

    def __init__(self, args: argparse.Namespace, texts: dict, folder: Path, env: dict):
        self.texts, self.folder, self.env = texts, folder, env
        self.files = {}
        for name in ("short", "long"):
            self.files[name] = folder / f"{name}.txt"
            self.files[name].write_text("\n".join(texts[name]) + "\n")
        self.vectors: dict[str, np.ndarray] = {}  # the first round's, by "contender set"
        self.decodes: dict[str, dict] = {}
        model, threads, batch = str(args.model), str(args.threads), args.batch
        self.quill = [QUILL, "embed", model, "--batch", str(batch), "--threads", threads]
        self.llama = [str(TOOLS / "llama-embedding"), "-m", model, "--embd-normalize", "2",
                      "--embd-output-format", "json", "-t", threads, "-b", str(batch),
                      "-ub", str(batch)]  # fmt: skip

    def commands(self) -> dict[str, str]:
        return {
            "quill embed": " ".join([*self.quill, "--no-stats", "< TEXTS.txt > OUT.jsonl"]),
            "quill embed, one text": " ".join([*self.quill, "TEXT"]),
            "llama-embedding": " ".join([*self.llama, "-f", "TEXTS.txt", "> OUT.json"]),
            "llama-embedding, one text": " ".join([*self.llama, "-p", "TEXT"]),
        }

    def quill_embed(self, name: str, number: int) -> dict:
        output = self.folder / f"quill-{name}.jsonl"
        if name == "one":  # with the stats line: its "load X s"
            wall, cpu, said = timed([*self.quill, self.texts["short"][0]], None, output, self.env)
            load = re.search(r"load ([\d.]+) s", said)
            return self._row(wall, cpu, 1, float(load.group(1)) if load else float("nan"))
        command = [*self.quill, "--no-stats"]
        wall, cpu, _ = timed(command, self.files[name], output, self.env)
        self._check("quill embed", name, quill_vectors(output), number)
        return self._row(wall, cpu, len(self.texts[name]))

    def llama_embedding(self, name: str, number: int) -> dict:
        output = self.folder / f"llama-{name}.json"
        text = ["-p", self.texts["short"][0]] if name == "one" else ["-f", str(self.files[name])]
        wall, cpu, said = timed([*self.llama, *text], None, output, self.env)
        if name != "one":
            self._check("llama-embedding", name, llama_vectors(output), number)
            sizes = decodes(said)
            self.decodes[name] = {"count": len(sizes), "min_tokens": min(sizes),
                                  "max_tokens": max(sizes)}  # fmt: skip
        return self._row(wall, cpu, len(self.texts.get(name, [0])), llama_load_s(said))

    @staticmethod
    def _row(wall: float, cpu: float, texts: int, load: float | None = None) -> dict:
        row = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 2), "texts_per_s": texts / wall}
        return row if load is None else row | {"load_s": load}

    def _check(self, who: str, name: str, vectors: np.ndarray, number: int) -> None:
        if vectors.ndim != 2 or vectors.shape[0] != len(self.texts[name]):
            raise SystemExit(f"{who}: {vectors.shape} for {len(self.texts[name])} {name} texts")
        if number == 0:
            self.vectors[f"{who} {name}"] = vectors


# --- the servers --------------------------------------------------------------------------------


def send_batches(
    url: str, model: str, texts: Sequence[str], per_request: int, clients: int
) -> tuple[float, np.ndarray, int]:
    """All texts, per_request to a POST /v1/embeddings, sent by clients threads back to back:
    (the wall seconds, the vectors in the texts' order, replies whose "index" fields were not
    0 to n-1). SystemExit if a request failed. A reply's rows are taken by their index where
    the indexes are 0 to n-1, else in the order they came (quill serve numbered the rows of
    requests sharing a pass from the pass's start until 457e0fd)."""
    chunks = [list(range(i, min(i + per_request, len(texts))))
              for i in range(0, len(texts), per_request)]  # fmt: skip
    todo, lock = iter(chunks), threading.Lock()
    vectors: list = [None] * len(texts)
    failures: list[str] = []
    misnumbered = [0]

    def client() -> None:
        with httpx.Client(timeout=600) as session:
            while True:
                with lock:
                    chunk = next(todo, None)
                if chunk is None or failures:
                    return
                body = {"model": model, "input": [texts[i] for i in chunk]}
                try:
                    reply = session.post(f"{url}/v1/embeddings", json=body)
                    data = reply.json()["data"] if reply.status_code == 200 else None
                except (httpx.HTTPError, ValueError, KeyError) as error:
                    data, reply = None, error
                if data is None or len(data) != len(chunk):
                    failures.append(str(getattr(reply, "text", reply))[:500])
                    return
                indexes = [row.get("index") for row in data]
                if sorted(indexes) != list(range(len(chunk))):
                    indexes = list(range(len(chunk)))
                    with lock:
                        misnumbered[0] += 1
                for index, row in zip(indexes, data, strict=True):
                    vectors[chunk[index]] = row["embedding"]

    wall = in_threads(client, clients)
    if failures or any(v is None for v in vectors):
        raise SystemExit(f"{url}: a request failed: {failures[:1]}")
    return wall, np.array(vectors, dtype=np.float64), misnumbered[0]


class Servers:
    """quill serve and llama-server, started for each measurement (not timed) and warmed up
    with one request: the contenders of a test."""

    def __init__(self, args: argparse.Namespace, texts: dict, home: Path):
        self.args, self.texts = args, texts
        self.env = users_env(QUILL_HOME=str(home))
        self.vectors: dict[str, np.ndarray] = {}
        model, threads = str(args.model), str(args.threads)
        llama_server = str(TOOLS / "llama-server")
        self.command = {
            "quill serve": [QUILL, "serve", model, "--threads", threads],
            "llama-server": [llama_server, "-m", model, "--embeddings", "-t", threads],
        }

    def commands(self) -> dict[str, str]:
        return {who: " ".join([*line, "--port", "PORT"]) for who, line in self.command.items()}

    def measure(self, who: str, name: str, number: int) -> dict:
        per = {"short": self.args.per_request, "long": self.args.long_per_request}[name]
        texts = self.texts[name]
        with serving(self.command[who], self.env, stderr=subprocess.DEVNULL) as (process, url):
            model = served_model(url)
            send_batches(url, model, self.texts["short"][:8], 8, 1)  # warm-up
            server = psutil.Process(process.pid)
            before = sum(server.cpu_times()[:2])
            wall, vectors, misnumbered = send_batches(url, model, texts, per, self.args.clients)
            cpu = sum(server.cpu_times()[:2]) - before
        if number == 0:
            self.vectors[f"{who} {name}"] = vectors
        return {"wall_s": round(wall, 3), "server_cpu_s": round(cpu, 2),
                "texts_per_s": len(texts) / wall, "misnumbered_replies": misnumbered}  # fmt: skip


# --- the report ---------------------------------------------------------------------------------


def min_cosine(ours: np.ndarray, theirs: np.ndarray) -> float:
    dots = np.sum(ours * theirs, axis=1)
    norms = np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    return float(np.min(dots / norms))


TESTS = {  # test: (label, quill's contender, llama.cpp's)
    "embed short": ("embed: {short} short texts (process wall)", "quill embed", "llama-embedding"),
    "embed long": ("embed: {long} long texts (process wall)", "quill embed", "llama-embedding"),
    "embed one": ("embed: 1 text (process wall, 1/s)", "quill embed", "llama-embedding"),
    "serve short": ("serve: {short} short texts, {clients} clients x {per_request}",
                    "quill serve", "llama-server"),
    "serve long": ("serve: {long} long texts, {clients} clients x {long_per_request}",
                   "quill serve", "llama-server"),
}  # fmt: skip


def median_of(rounds: list[dict], who: str, key: str) -> float:
    values = [r[who][key] for r in rounds if key in r[who]]
    return statistics.median(values) if values else float("nan")


def report(record: dict) -> str:
    settings, tokens = record["settings"], record["texts"]
    lines = [f"# Embeddings: quill against llama.cpp's tools ({record['date']})", "",
             f"{record['machine']}; quill {record['commit']}; llama-cpp-python "
             f"{record['llama_cpp_python']}; {Path(record['model']).name}; {settings['threads']} "
             f"threads; {settings['rounds']} rounds of each test, the two contenders of a test "
             "measured one after the other, who goes first turning each round "
             "(benchmarks/embed.py). Short texts: "
             f"{tokens['short']['count']} of {tokens['short']['min']}-{tokens['short']['max']} "
             f"tokens (median {tokens['short']['median']}); long: {tokens['long']['count']} of "
             f"{tokens['long']['min']}-{tokens['long']['max']} (median "
             f"{tokens['long']['median']}). A pair is quiet when other processes took under "
             f"{QUIET:.0%} of one core beside each of its two measurements; a ratio is judged "
             "on the quiet pairs' median where there are three or more.", "",
             f"`{record['command']}`", "",
             "| test | quill texts/s | llama.cpp texts/s | ratio: per-round median (min-max) | "
             f"quiet pairs: n, median | >= {TARGET} |", "|---|---|---|---|---|---|"]  # fmt: skip
    measured = {test: TESTS[test] for test in TESTS if test in record["rounds"]}
    for test, (label, ours, theirs) in measured.items():
        ratio = paired(record["rounds"][test], "texts_per_s", ours, theirs)
        lines.append(f"| {label.format(**settings)} | {ratio.ours:.1f} | {ratio.reference:.1f} | "
                     f"{ratio.cells()} | {ratio.verdict(TARGET)} |")  # fmt: skip
    lines += ["", "Seconds, medians over rounds (CPU: the tool's user + system; for a server, "
              "the server process's while the clients ran):", "",
              "| test | quill wall | llama.cpp wall | quill CPU | llama.cpp CPU | quill load "
              "| llama.cpp load |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for test, (_, ours, theirs) in measured.items():
        rounds = record["rounds"][test]
        cpu = "server_cpu_s" if test.startswith("serve") else "cpu_s"
        cells = [median_of(rounds, who, key) for key in ("wall_s", cpu, "load_s")
                 for who in (ours, theirs)]  # fmt: skip
        shown = ("-" if c != c else f"{c:.3f}" for c in cells)  # nan: not measured
        lines.append(f"| {test} | " + " | ".join(shown) + " |")
    lines += ["", "Vector agreement (first round, every text; min cosine):", ""]
    lines += [f"- {pair}: {value:.7f}" for pair, value in record["cosine"].items()]
    lines += ["", "Commands:", ""]
    lines += [f"- {name}: `{command}`" for name, command in record["commands"].items()]
    lines += ["", "Notes:", "", *(f"- {note}" for note in record.get("notes", []))]
    return "\n".join(lines) + "\n"


def notes(record: dict) -> list[str]:
    decoded = record["llama_embedding_decodes"]
    said = [
        f"Both command-line tools decode up to {record['settings'].get('batch', BATCH)} tokens "
        "of many texts at once (llama-embedding's "
        "decodes, last round: " + "; ".join(
            f"{name} texts {d['count']} of {d['min_tokens']}-{d['max_tokens']} tokens"
            for name, d in decoded.items()
        ) + "). llama-embedding's context is the model's 512, quill embed's its batch; "
        "BERT keeps no KV cache, so neither bounds a decode. llama-embedding's load is its log's "
        "timestamp at system_info; quill's is its stats line's (the one-text run, which prints "
        "it; the timed runs pass --no-stats).",
        "The servers run with their defaults apart from the model, --embeddings and threads: "
        "llama-server makes 4 slots and lowers n_batch to n_ubatch = 512 with --embeddings (an "
        "input must fit one ubatch: every input here does); quill serve's embedder decodes 512 "
        "tokens at a time, any number of texts to a decode. The clients parse the replies' JSON "
        "on the same cores as the server.",
    ]  # fmt: skip
    misnumbered = sum(r["quill serve"].get("misnumbered_replies", 0)
                      for test in ("serve short", "serve long")
                      for r in record["rounds"].get(test, []))  # fmt: skip
    if misnumbered:
        said.append(
            f"quill serve numbered the rows of {misnumbered} replies wrongly (over all rounds): "
            "a request that shares a pass with others gets indexes counted from the pass's first "
            "text, not 0 (cli/engine/embedqueue.py keeps Embedder.embed's running index). The "
            "rows come in order, so the client here took them in order."
        )
    return said


def summary(counts: list[int]) -> dict:
    return {"count": len(counts), "min": min(counts), "median": statistics.median(counts),
            "max": max(counts), "total": sum(counts)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=BATCH, help="tokens per decode, both CLIs")
    parser.add_argument("--short", type=int, default=1000, help="short texts")
    parser.add_argument("--long", type=int, default=200, help="long texts")
    parser.add_argument("--long-tokens", type=int, default=400, help="about this many each")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--per-request", type=int, default=16, help="short texts a request")
    parser.add_argument("--long-per-request", type=int, default=8, help="long texts a request")
    parser.add_argument("--tests", nargs="+", choices=list(TESTS), default=list(TESTS))
    add_quiet_wait(parser, 30.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "embed.json")
    args = parser.parse_args()
    refuse_omp_wait_policy()
    commit, machine = quill_commit(), machine_line()
    print(machine, flush=True)
    texts = make_texts(args.model, args.short, args.long, args.long_tokens)
    folder = Path(tempfile.mkdtemp(prefix="quill-embed-bench-"))
    try:
        tools = Tools(args, texts, folder, users_env(QUILL_HOME=str(folder / "home")))
        servers = Servers(args, texts, folder / "home")
        tests: dict[str, dict[str, Callable[[int], dict]]] = {}
        for test in args.tests:
            kind, name = test.split()
            if kind == "embed":
                tests[test] = {"quill embed": partial(tools.quill_embed, name),
                               "llama-embedding": partial(tools.llama_embedding, name)}  # fmt: skip
            else:
                tests[test] = {who: partial(servers.measure, who, name) for who in servers.command}
        started, clock = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
        rounds: dict[str, list] = {test: [] for test in tests}
        for number in range(args.rounds):  # every test once a round: a busy spell hits them all
            for test, contenders in tests.items():
                print(f"{test}:", file=sys.stderr, end=" ", flush=True)
                (measured,) = interleave(contenders, 1, number, quiet_limit=args.quiet_wait)
                rounds[test].append(measured)
        vectors = tools.vectors | servers.vectors
        pairs = [("quill embed", "llama-embedding", name) for name in ("short", "long")]
        pairs += [("quill serve", "llama-server", name) for name in ("short", "long")]
        pairs += [("quill embed", "quill serve", "short"), ("quill embed", "quill serve", "long")]
        cosine = {
            f"{ours} / {theirs}, {name} ({len(texts[name])} texts)": min_cosine(
                vectors[f"{ours} {name}"], vectors[f"{theirs} {name}"]
            )
            for ours, theirs, name in pairs
            if f"{ours} {name}" in vectors and f"{theirs} {name}" in vectors
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    keys = ("rounds", "threads", "batch", "short", "long", "long_tokens", "clients",
            "per_request", "long_per_request")  # fmt: skip
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine,
        "commit": commit,
        "command": command_line("benchmarks.embed"),
        "llama_cpp_python": version("llama-cpp-python"),
        "model": str(args.model),
        "started": started,
        "seconds": round(time.perf_counter() - clock),
        "settings": {key: getattr(args, key) for key in keys},
        "texts": {name: summary(counts) for name, counts in texts["tokens"].items()},
        "commands": tools.commands() | servers.commands(),
        "llama_embedding_decodes": tools.decodes,
        "cosine": cosine,
        "ratios": {},
        "rounds": rounds,
    }
    for test in rounds:
        _, ours, theirs = TESTS[test]
        ratio = paired(rounds[test], "texts_per_s", ours, theirs)
        record["ratios"][test] = {"median": ratio.median, "judged": ratio.judged,
                                  "per_round": ratio.ratios, "quiet": ratio.calm,
                                  "met": ratio.judged >= TARGET}  # fmt: skip
    record["notes"] = notes(record)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    args.json.with_suffix(".md").write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()

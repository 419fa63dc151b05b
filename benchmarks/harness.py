"""What the benchmarks share, so that each script holds only its own comparison:

- the machine: its line in a results file, how busy other processes keep it (a shared machine),
  waiting for it to be quiet, one busy core beside a run, a process's RSS, OpenMP as users have it;
- servers: `quill serve` or `llama-server` started on a free port of 127.0.0.1 and waited for;
- streams: one streamed chat request, read by cli/api/client.py's SSE reader (the client that
  `quill chat --endpoint` uses), timed as a client sees it;
- ratios: contenders measured in turns, in an order that turns each round, and the medians of
  their per-round ratios, over all rounds and over the quiet ones.

Scripts run from the repository root: `python -m benchmarks.NAME`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
QUILL = str(Path(sys.executable).with_name("quill"))
# llama.cpp's tools built from quill's own sdist (benchmarks/build_llama_bench.sh); a worktree
# uses the main checkout's build.
_BUILD = Path("benchmarks", ".build", f"llama-cpp-python-{version('llama-cpp-python')}", "build")
TOOLS = next(
    (p / "bin" for p in (ROOT / _BUILD, ROOT.parent / "main" / _BUILD) if p.exists()),
    ROOT / _BUILD / "bin",
)
QUIET = 0.05  # a measurement is quiet when other work took under 5% of one core beside it


# --- the machine --------------------------------------------------------------------------------


def machine_line() -> str:
    """The CPU as a results file names it: a VM's model name ("AMD EPYC") hides the generation,
    so the family and model numbers go beside it (Zen 4 is family 25, Zen 5 family 26)."""
    from cli.engine.hardware import cpu_model

    lines = Path("/proc/cpuinfo").read_text().splitlines()
    fields = {key.strip(): value.strip() for key, _, value in (s.partition(":") for s in lines)}
    family, model = fields.get("cpu family"), fields.get("model")
    generation = f" (family {family}, model {model})" if family else ""
    return f"{cpu_model()}{generation}, {os.cpu_count()} CPUs"


def users_env(**more: str) -> dict[str, str]:
    """This environment as a user has it: OMP_WAIT_POLICY unset (OpenMP's threads spin a while),
    and Python's compiled modules kept, as an installed package's are (pip compiles them): with
    PYTHONDONTWRITEBYTECODE, which this machine sets, quill's editable install compiled some 70
    modules at every start, ~90 ms that no user's quill pays."""
    unset = ("OMP_WAIT_POLICY", "PYTHONDONTWRITEBYTECODE")
    return {k: v for k, v in os.environ.items() if k not in unset} | more


def refuse_omp_wait_policy() -> None:
    if "OMP_WAIT_POLICY" in os.environ:
        raise SystemExit("unset OMP_WAIT_POLICY: benchmarks run with OpenMP as users have it")


def quill_commit() -> str:
    """The commit measured (take it before a run: the tree may change meanwhile)."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() or "unknown"


def command_line(module: str) -> str:
    """How this run was started, as a results file quotes it: `python -m benchmarks.NAME ...`."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy, less this process's and its children's: how
    much other work ran beside a measurement (the machine is shared)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    own = os.times()
    return busy - (own.user + own.system + own.children_user + own.children_system)


def wait_quiet(share: float = QUIET, window: float = 3.0, limit: float = 120.0) -> None:
    """Until other processes take under share of one core over a window (at most limit s):
    tests running beside a benchmark are not under its lock."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        before = busy_seconds()
        time.sleep(window)
        if busy_seconds() - before < share * window:
            return


def machine_load(seconds: float = 2.0) -> tuple[float, list[float]]:
    """How busy the machine is (other sessions share it): percent of all CPUs over seconds, and
    the load average over 1, 5 and 15 minutes."""
    return psutil.cpu_percent(interval=seconds), list(os.getloadavg())


_SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_core(deadline_s: float | None = None) -> Iterator[subprocess.Popen]:
    """One core kept busy while the block runs: `yes > /dev/null`, or with deadline_s a Python
    spin loop that also stops itself then. Killed when the block ends."""
    command = (
        ["yes"] if deadline_s is None else [sys.executable, "-c", _SPIN.format(seconds=deadline_s)]
    )
    spinner = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)  # running before the measurement starts
        yield spinner
    finally:
        spinner.kill()
        spinner.wait()


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    """VmRSS (now) or VmHWM (peak) of a live process, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"{field}:\s+(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else 0.0


# --- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until the server at url answers GET /v1/models; SystemExit if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            said = process.stderr.read() if process.stderr else ""
            raise SystemExit(f"{shlex.join(map(str, process.args))[:300]} exited: {said[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered (a server with an API key refuses the request: it is up)
        except OSError:
            time.sleep(0.2)
    stop_server(process)
    raise SystemExit(f"{url} did not come up in {timeout} s")


def start_server(
    command: Sequence[str],
    env: dict[str, str] | None = None,
    stderr: int | None = subprocess.PIPE,
    timeout: float = 300,
) -> tuple[subprocess.Popen, str]:
    """`quill serve ...` or `llama-server ...` (without --port) on a free port of 127.0.0.1, once
    it answers: (the process, http://127.0.0.1:PORT). stderr=PIPE keeps what it said for the
    error if it does not start; read it or pass DEVNULL for a long run."""
    port = free_port()
    process = subprocess.Popen([*command, "--port", str(port)], env=env,
                               stdout=subprocess.DEVNULL, stderr=stderr, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, timeout)
    return process, url


def stop_server(process: subprocess.Popen, timeout: float = 60) -> None:
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def serving(command: Sequence[str], env: dict[str, str] | None = None, **start) -> Iterator[tuple]:
    """start_server for the length of the block: (process, url)."""
    process, url = start_server(command, env, **start)
    try:
        yield process, url
    finally:
        stop_server(process)


# --- streams ------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One streamed reply as the client saw it, token counts as the server counted them."""

    ttft_s: float  # from sending the request to the first content chunk
    decode_tokens_per_s: float  # content chunks after the first over the time they took
    chunks: int
    prompt_tokens: int
    completion_tokens: int


def served_model(url: str) -> str:
    """The name to ask for: the first model the server lists (asked once, not per request)."""
    from cli.api.client import first_model

    return first_model(url, None) or "default"


def chat_reply(url: str, prompt: str, max_tokens: int, model: str) -> Reply:
    """One streamed greedy chat request (ignore_eos: it decodes max_tokens), read by the same
    SSE reader as `quill chat --endpoint`."""
    from cli.api.client import stream_chat
    from cli.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    events = list(stream_chat(url, [("user", prompt)], model, max_tokens, greedy))
    *content, last = events
    rate = content[-1].decode_tokens_per_s if content else 0.0
    return Reply(last.prefill_s, rate, len(content), last.prompt_tokens, last.generation_tokens)


def send_concurrently(
    url: str, model: str, clients: int, requests: int, prompts: Sequence[str], max_tokens: int
) -> tuple[list[Reply], float]:
    """requests chat_replies (prompts in turn) sent by clients threads, each back to back: the
    replies and the wall seconds of all of them. SystemExit if any failed."""
    todo, replies, lock = iter(range(requests)), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                index = next(todo, None)
            if index is None:
                return
            reply = chat_reply(url, prompts[index % len(prompts)], max_tokens, model)
            with lock:
                replies.append(reply)

    wall = in_threads(client, clients)
    if len(replies) != requests:
        raise SystemExit(f"{url}: {requests - len(replies)} requests failed")
    return replies, wall


def in_threads(client: Callable[[], None], count: int) -> float:
    """client run in count threads at once, until all end: the wall seconds."""
    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


# --- ratios -------------------------------------------------------------------------------------


def turned(items: Sequence, turn: int) -> list:
    """items in the order of a round: each round starts one later, so that over the rounds every
    contender has every place in the order (the place moves a ratio by several percent here)."""
    shift = turn % len(items)
    return [*items[shift:], *items[:shift]]


def interleave(
    contenders: dict[str, Callable[[int], dict]],
    rounds: int,
    first_turn: int = 0,
    quiet_limit: float = 120.0,
) -> list[dict[str, dict]]:
    """rounds of each contender in turn, each measurement after waiting (at most quiet_limit s)
    for a quiet machine, with its seconds and the CPU seconds other processes took beside it."""
    results = []
    for number in range(rounds):
        measured = {}
        for name in turned(list(contenders), number + first_turn):
            wait_quiet(limit=quiet_limit)
            before, clock = busy_seconds(), time.perf_counter()
            measured[name] = contenders[name](number)
            measured[name]["seconds"] = round(time.perf_counter() - clock, 1)
            measured[name]["foreign_cpu_s"] = round(busy_seconds() - before, 1)
            print(f"round {number + 1}: {name} {measured[name]}", file=sys.stderr, flush=True)
        results.append(measured)
    return results


def add_quiet_wait(parser: argparse.ArgumentParser, default: float) -> None:
    """--quiet-wait: how long interleave waits for a quiet machine before each measurement."""
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=default,
        help="seconds to wait at most for a quiet machine, each measurement",
    )


def quiet(result: dict) -> bool:
    return result.get("foreign_cpu_s", float("inf")) < QUIET * result.get("seconds", 0)


@dataclass
class Ratio:
    """ours / reference over paired rounds: the medians, the per-round ratios, and those of the
    quiet pairs (both measurements quiet)."""

    ours: float
    reference: float
    ratios: list[float]
    calm: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def judged(self) -> float:
        """What a target is judged on: the quiet pairs' median where there are three or more."""
        return statistics.median(self.calm) if len(self.calm) >= 3 else self.median

    def cells(self) -> str:
        """`median (min-max) | quiet pairs: n, median`, as the results tables show it."""
        calm = f"{len(self.calm)}, {statistics.median(self.calm):.3f}" if self.calm else "0"
        low, high = min(self.ratios), max(self.ratios)
        return f"{self.median:.3f} ({low:.3f}-{high:.3f}) | {calm}"

    def verdict(self, target: float) -> str:
        return f">= {target}: " + ("met" if self.judged >= target else "NOT met")


def paired(rounds: list[dict[str, dict]], test: str, ours: str, reference: str) -> Ratio:
    """The ratio of ours to reference on test over rounds that measured both."""
    mine = [r[ours][test] for r in rounds]
    theirs = [r[reference][test] for r in rounds]
    calm = [a / b for r, a, b in zip(rounds, mine, theirs, strict=True)
            if quiet(r[ours]) and quiet(r[reference])]  # fmt: skip
    ratios = [a / b for a, b in zip(mine, theirs, strict=True)]
    return Ratio(statistics.median(mine), statistics.median(theirs), ratios, calm)


def median_ms(action: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The median milliseconds of repeat calls of action, and what the last call returned."""
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = action()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result

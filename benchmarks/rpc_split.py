"""A 1B-class replica split across two local RPC servers (issue 28): quill against llama.cpp's
own client, and each against its local run.

Per round, in turn (the order turns each round; harness.py's interleave, which waits for a
quiet machine before each measurement and records the CPU other processes took beside it):
  llama.cpp rpc:   two `ggml-rpc-server -t T` on 127.0.0.1 (free ports), then
                   `llama-bench --rpc A,B -ngl 99 -p 512 -n 128 -r 1 -o json -v`;
  quill rpc:       two `quill rpc-server --threads T` on 127.0.0.1, then
                   `quill bench MODEL --rpc A,B -p 512 -n 128 -r 1 --json`;
  llama.cpp local, quill local: the same two benches without --rpc; "local plain": with weight
                   repacking off, as the servers hold the weights (RPC has no repacked type).
Both sides: the same threads (T, default 1: a layer split runs the servers one after another,
so the local run with T threads does the same compute and the difference is what RPC costs),
batch and ubatch 512, flash attention auto, weight repacking as quill's CPU path has it, f16 KV;
the servers are fresh each measurement. Which device got which buffers is recorded per side:
llama-bench's verbose buffer lines, quill's split as inspect --rpc plans it, and what each
server's memory grew by while the client ran.
--only picks contenders, among them crossed ones (each client on the other's servers, and
ggml-rpc-server on quill's libraries): which side a difference comes from.
--servers-from REV adds "quill rpc, servers at REV": the same client on `quill rpc-server`s run
from quill's cli/ at git revision REV (the rest of the venv as it is): what a change to the
server costs, e.g. the relay in front of llama.cpp's server:
  python -m benchmarks.rpc_split --rounds 6 --only "quill rpc" "quill rpc, servers at REV" \
      --servers-from REV --json benchmarks/results/rpc-relay-2026-12-02.json
Each run adds its rounds to --json and rewrites the .md beside it from all rounds so far
(medians, and medians of the per-round ratios; a pair over the rounds that had both), so
several runs under ~10 minutes make a result:
  flock /work/notes/bench.lock python -m benchmarks.rpc_split --rounds 2
  flock /work/notes/bench.lock python -m benchmarks.rpc_split --rounds 8 --only "llama.cpp rpc" \
      "quill rpc"
OpenMP as users have it: refuses to run with OMP_WAIT_POLICY set.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

from benchmarks.harness import (
    QUIET,
    QUILL,
    RESULTS,
    ROOT,
    TOOLS,
    add_quiet_wait,
    command_line,
    free_port,
    interleave,
    machine_line,
    paired,
    refuse_omp_wait_policy,
    rss_mib,
    stop_server,
    users_env,
)

MODEL = Path("/work/shapes/llama-3.2-1b-shape.Q4_K_M.gguf")
TARGET = 0.95  # issue 28: quill >= 0.95x of llama.cpp's figures over the same split
BUFFER = re.compile(r"(\S+) +(model|KV|compute) buffer size = +([\d.]+) MiB")


@contextmanager
def servers(command: list[str], port_flag: str, env: dict[str, str]) -> Iterator[list]:
    """Two RPC servers on 127.0.0.1, each ready for a client: yields [(endpoint, process, its
    RSS when ready in MiB)]."""
    started = []
    with tempfile.TemporaryDirectory() as logs:
        try:
            for letter in "AB":
                port, log = free_port(), Path(logs, letter)
                with log.open("wb") as out:
                    process = subprocess.Popen([*command, port_flag, str(port)], env=env,
                                               stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
                started.append((f"127.0.0.1:{port}", process, log))
            for endpoint, process, log in started:
                wait_listening(int(endpoint.split(":")[1]), process, log)
            yield [(endpoint, process, rss_mib(process.pid)) for endpoint, process, _ in started]
        finally:
            for _, process, _ in started:
                stop_server(process, timeout=30)


def wait_listening(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:  # the server serves one client at a time; a bare connect is let go at once
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                text = log.read_text(errors="replace")[-2000:]
                raise SystemExit(f"{shlex.join(process.args)} did not start:\n{text}") from None
            time.sleep(0.2)


def named(text: str, endpoints: list[str]) -> str:
    """Ports change every round: name the servers A and B instead."""
    for index, endpoint in enumerate(endpoints):
        text = text.replace(endpoint, f"server {'AB'[index]}")
    return text


def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)[:400]} failed:\n{done.stderr[-3000:]}")
    return done


def wheel_libraries() -> Path:
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def checkout(revision: str) -> Path:
    """quill's cli/ package at revision, in a temporary folder, for PYTHONPATH."""
    folder = Path(tempfile.mkdtemp(prefix="quill-at-"))
    archive = subprocess.run(["git", "archive", revision, "cli"], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def contenders(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict, dict]:
    from cli.engine.loading import amx_present

    # quill's CPU path off AMX is llama.cpp's extra buffers (llama-bench --repack 1).
    repack = not amx_present()
    t, model = str(args.threads), str(args.model)
    bench = [str(TOOLS / "llama-bench"), "-m", model, "-t", t, "-p", "512", "-n", "128",
             "-r", "1", "-b", "512", "-ub", "512", "-fa", "auto", "-ngl", "99", "-o", "json",
             "-v", "--repack"]  # fmt: skip
    quill = [QUILL, "bench", model, "-t", t, "-p", "512", "-n", "128", "-r", "1", "-b", "512",
             "--json", "--repack"]  # fmt: skip
    flags = {"llama.cpp": {True: "1", False: "0"}, "quill": {True: "on", False: "off"}}
    server_commands = {
        "llama.cpp": ([str(TOOLS / "ggml-rpc-server"), "-t", t], "-p"),
        "quill": ([QUILL, "rpc-server", "--threads", t], "--port"),
        # -P: the cwd stays off sys.path, so PYTHONPATH's cli/ comes before the editable install
        "quill at REV": ([sys.executable, "-P", "-m", "cli", "rpc-server", "--threads", t],
                         "--port"),
    }  # fmt: skip

    def llama_bench(extra: list[str], endpoints: list[str], repack: bool = repack) -> dict:
        done = run([*bench, flags["llama.cpp"][repack], *extra], env)
        rows = json.loads(done.stdout)
        buffers = {f"{kind} {named(device, endpoints)}": float(mib)
                   for device, kind, mib in BUFFER.findall(done.stderr)}  # fmt: skip
        rates = {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in rows}
        # llama-bench's test_prompt ends in llama_synchronize: its rate is already to the end.
        return rates | {"pp512_ttft": rates["pp512"]} | {
            "build": rows[0]["build_commit"], "backends": rows[0]["backends"], "buffers": buffers
        }  # fmt: skip

    def quill_bench(extra: list[str], endpoints: list[str], repack: bool = repack) -> dict:
        done = run([*quill, flags["quill"][repack], *extra], env)
        rows = json.loads(done.stdout)["rows"]
        result = {r["test"]: r["tokens_per_s"] for r in rows}
        # quill's reported prefill rate stops its clock when llama_decode returns, and over RPC
        # (an async backend) the servers are still computing then; the first token waits for them.
        pp = next(r for r in rows if r["test"] == "pp512")
        result["pp512_ttft"] = 512 / (pp["ttft_ms"] / 1000)
        result["rpc"] = [named(server, endpoints) for server in rows[0]["rpc"]]
        result["notes"] = named(done.stderr.strip(), endpoints).splitlines()
        if endpoints:  # quill's plan of the split, as inspect --rpc shows it
            plan = json.loads(run([QUILL, "inspect", model, "--json", *extra], env).stdout)
            result["plan"] = {named(d["device"], endpoints): {"layers": d["layers"],
                              "weights_mib": round(d["weights_bytes"] / 2**20, 1),
                              "kv_mib": round(d["kv_bytes"] / 2**20, 1)}
                              for d in plan["rpc_split"]}  # fmt: skip
        return result

    def split(side: str, measure: Callable, server_env: dict[str, str] = env) -> Callable:
        def measure_split(_round: int) -> dict:
            command, port_flag = server_commands[side]
            with servers(command, port_flag, server_env) as pair:
                endpoints = [endpoint for endpoint, _, _ in pair]
                result = measure(["--rpc", ",".join(endpoints)], endpoints)
                # What the client's buffers cost each server, whichever program serves them.
                rss = {f"server {letter}": {"ready": round(ready, 1),
                                            "peak": round(rss_mib(process.pid, "VmHWM"), 1)}
                       for letter, (_, process, ready) in zip("AB", pair, strict=True)}  # fmt: skip
            return result | {"servers_rss_mib": rss}

        return measure_split

    measures = {
        "llama.cpp rpc": split("llama.cpp", llama_bench),
        "quill rpc": split("quill", quill_bench),
        # Crossed (--only): which of client and server a difference comes from.
        "quill on llama.cpp servers": split("llama.cpp", quill_bench),
        "llama-bench on quill servers": split("quill", llama_bench),
        # ggml-rpc-server on the libraries quill loads (the pip-built wheel's): build or process?
        "llama-bench on ggml-rpc-server with quill's libraries": split(
            "llama.cpp", llama_bench, env | {"LD_LIBRARY_PATH": str(wheel_libraries())}
        ),
        "llama.cpp local": lambda _round: llama_bench([], []),
        "quill local": lambda _round: quill_bench([], []),
        # --servers-from: the same client on servers from another commit of quill.
        "quill rpc, servers at REV": split(
            "quill at REV",
            quill_bench,
            env | {"PYTHONPATH": str(checkout(args.servers_from)) if args.servers_from else ""},
        ),
        # The servers' CPU buffers are plain (RPC offers no repacked type): the same compute.
        "llama.cpp local plain": lambda _round: llama_bench([], [], repack=False),
        "quill local plain": lambda _round: quill_bench([], [], repack=False),
    }
    commands = {
        "servers (llama.cpp)": shlex.join([*server_commands["llama.cpp"][0], "-p", "PORT"]),
        "servers (quill)": shlex.join([*server_commands["quill"][0], "--port", "PORT"]),
        "llama.cpp rpc": shlex.join([*bench, flags["llama.cpp"][repack], "--rpc", "A,B"]),
        "quill rpc": shlex.join([*quill, flags["quill"][repack], "--rpc", "A,B"]),
        "crossed": "the same clients, each on the other's servers; ggml-rpc-server with "
        "LD_LIBRARY_PATH set to quill's llama_cpp/lib",
        "llama.cpp local": shlex.join([*bench, flags["llama.cpp"][repack]]),
        "quill local": shlex.join([*quill, flags["quill"][repack]]),
        "llama.cpp local plain": shlex.join([*bench, "0"]),
        "quill local plain": shlex.join([*quill, "off"]),
    }
    if args.servers_from:
        commands["servers at REV"] = f"REV = {args.servers_from}, PYTHONPATH=<its cli/> " + (
            shlex.join([*server_commands["quill at REV"][0], "--port", "PORT"])
        )
    return measures, {"commands": commands, "weight_repacking": repack}


TESTS = {"pp512_ttft": "pp512", "tg128": "tg128"}  # pp512 as quill reports it: in the json
PAIRS = [  # (what the ratio says, quill's or the split's side, the reference, target)
    ("quill / llama.cpp, split", "quill rpc", "llama.cpp rpc", TARGET),
    ("quill's servers / quill's servers at REV, quill as client", "quill rpc",
     "quill rpc, servers at REV", 0.98),
    ("quill / llama.cpp, local", "quill local", "llama.cpp local", None),
    ("quill / llama.cpp, local plain", "quill local plain", "llama.cpp local plain", None),
    ("split / local, llama.cpp", "llama.cpp rpc", "llama.cpp local", None),
    ("split / local, quill", "quill rpc", "quill local", None),
    ("split / local plain, llama.cpp", "llama.cpp rpc", "llama.cpp local plain", None),
    ("split / local plain, quill", "quill rpc", "quill local plain", None),
    ("quill / llama.cpp, split on llama.cpp's servers", "quill on llama.cpp servers",
     "llama.cpp rpc", None),
    ("quill's / llama.cpp's servers, llama-bench as client", "llama-bench on quill servers",
     "llama.cpp rpc", None),
    ("ggml-rpc-server on quill's libraries / on its own, llama-bench as client",
     "llama-bench on ggml-rpc-server with quill's libraries", "llama.cpp rpc", None),
    ("quill's servers / ggml-rpc-server on quill's libraries, llama-bench as client",
     "llama-bench on quill servers", "llama-bench on ggml-rpc-server with quill's libraries",
     None),
]  # fmt: skip
DEFAULT = ("llama.cpp rpc", "quill rpc", "llama.cpp local", "quill local",
           "llama.cpp local plain", "quill local plain")  # fmt: skip


def report(record: dict) -> str:
    runs = record["runs"]
    rounds = [r for run in runs for r in run["rounds"]]
    last = runs[-1]
    lines = [f"# A 1B-class replica split across two local RPC servers ({record['date']})", "",
             f"{record['cpu']}; llama-cpp-python {record['llama_cpp_python']}; "
             f"{Path(last['model']).name}; {last['threads']} thread(s) per server, client and "
             f"local run; weight repacking {'on' if last['weight_repacking'] else 'off'} as "
             "quill's CPU path has it (the servers hold plain CPU buffers: RPC offers no "
             "repacked type; 'local plain' is the local run with repacking off); OpenMP's "
             f"default wait policy; {len(rounds)} interleaved rounds in {len(runs)} runs "
             "(benchmarks/rpc_split.py). A pair is quiet when other processes took under "
             f"{QUIET:.0%} of one core beside each of its two measurements.", "",
             "quill's pp512 is 512 / its time to the first token: its reported prefill rate "
             "stopped the clock when llama_decode returned, before an async backend (RPC) had "
             "finished, until 8b4d5b7 (both are in the json). llama-bench's pp512 ends in "
             "llama_synchronize.", "",
             "Commands (A, B: the two servers' 127.0.0.1:PORT):", ""]  # fmt: skip
    lines += [f"- {name}: `{command}`" for name, command in last["commands"].items()]
    lines += ["", "| test | ratio | tok/s (median) | reference tok/s (median) | per-round ratio: "
              "median (min-max) | quiet pairs: n, median | target |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for test in TESTS:
        for label, ours, theirs, target in PAIRS:
            both = [r for r in rounds if ours in r and theirs in r]
            if not both:
                continue
            ratio = paired(both, test, ours, theirs)
            verdict = "" if target is None else ratio.verdict(target)
            lines.append(
                f"| {TESTS[test]} | {label} ({len(both)}) | {ratio.ours:.2f} | "
                f"{ratio.reference:.2f} | {ratio.cells()} | {verdict} |"
            )
    quill_rounds = [r for r in rounds if "quill rpc" in r]
    last_split = ([r for r in quill_rounds if "llama.cpp rpc" in r] or quill_rounds)[-1]
    last_quill = last_split["quill rpc"]
    lines += ["", "Where the layers went (last round)."]
    if "llama.cpp rpc" in last_split:
        lines[-1] += " llama-bench's buffer lines (MiB): " + "; ".join(
            f"{name} {size:.1f}" for name, size in last_split["llama.cpp rpc"]["buffers"].items()
        ) + "."  # fmt: skip
    lines += ["", "quill's split (inspect --rpc, the plan its load follows; KV at inspect's "
              "context of 4096): "
              + "; ".join(f"{device}: layers {_span(d['layers'])}, weights {d['weights_mib']}, "
                          f"KV {d['kv_mib']}" for device, d in last_quill["plan"].items())
              + " (the last layer is the output layer).",
              "", "What each server's memory grew by while the client ran (peak RSS less RSS "
              "when ready, MiB, median over rounds): the same split costs each server alike, "
              "whichever client and server program.", ""]  # fmt: skip
    for side in [s for s in ("llama.cpp rpc", "quill rpc", "quill rpc, servers at REV")
                 if any(s in r for r in rounds)]:  # fmt: skip
        grew = {s: statistics.median(r[side]["servers_rss_mib"][s]["peak"]
                                     - r[side]["servers_rss_mib"][s]["ready"]
                                     for r in rounds if side in r)
                for s in ("server A", "server B")}  # fmt: skip
        lines.append(f"- {side}: " + ", ".join(f"{s} +{v:.0f}" for s, v in grew.items()))
    lines += ["", *record.get("notes", [])]
    return "\n".join(lines) + "\n"


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="per server, client, local run")
    parser.add_argument("--only", nargs="+", help="these contenders instead of the six")
    parser.add_argument("--servers-from", metavar="REV", help="a git revision of quill")
    add_quiet_wait(parser, 120.0)
    parser.add_argument("--json", type=Path, default=RESULTS / "rpc-split-2026-12-02.json")
    args = parser.parse_args()
    refuse_omp_wait_policy()
    env = users_env(QUILL_HOME=tempfile.mkdtemp(prefix="quill-rpc-split-"))
    measures, facts = contenders(args, env)
    measures = {name: measures[name] for name in args.only or DEFAULT}
    record = (
        json.loads(args.json.read_text())
        if args.json.exists()
        else {"date": time.strftime("%Y-%m-%d"), "cpu": machine_line(),
              "llama_cpp_python": version("llama-cpp-python"), "runs": []}
    )  # fmt: skip
    first_turn = sum(len(run["rounds"]) for run in record["runs"])  # who goes first turns
    started, clock = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
    rounds = interleave(measures, args.rounds, first_turn, quiet_limit=args.quiet_wait)
    entry = {"started": started, "seconds": round(time.perf_counter() - clock), **facts,
           "model": str(args.model), "threads": args.threads,
           "command": command_line("benchmarks.rpc_split"), "rounds": rounds}  # fmt: skip
    record["runs"].append(entry)
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    args.json.with_suffix(".md").write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()

"""quill against llama.cpp's own tools at the scale users run (issue 27), on random-weight files
with real models' shapes (benchmarks/shapes.py makes them in /work/shapes).

  decode: on an 8B-class Q4_K_M, per round: `quill run` twice as a user runs it (a fresh process;
          a 512-token prompt for prefill, then a 2-token prompt and 128 tokens for decode),
          quill's engine in this process as `quill bench` drives it (pp512, tg128), and
          `llama-bench -p 512 -n 128 -r 1`. Same threads, batch and ubatch (512), flash
          attention (auto), weight repacking (llama-bench's --repack as quill's CPU path), f16 KV.
  tg:     on the 8B-class file, decode alone: `quill run` (a 2-token prompt, 129 tokens) and
          `llama-bench -p 0 -n 128 -r 1` back to back, each a fresh process.
  overhead: on the 8B-class file, in one process, llama-bench's own loops (llama_decode on
          llama_batch_get_one, no sampling) on quill's context against quill's engine, in turn
          every few seconds: what quill adds to llama.cpp, with the host's slower drift cancelled
          (end to end, separate processes minutes apart, rounds range 0.75-1.3x here).
  serve:  on a 1B-class Q4_K_M, per round: `quill serve -np 4` and `llama-server -np 4` (the
          same context per slot, threads, batch, flash attention, repacking), each sent 16
          streaming chat requests (serve_load.py's prompts, 64 tokens, greedy, ignore_eos) by 4
          client threads; throughput = completion tokens (usage) / wall time.
The order of the contenders turns each round and goes on turning from run to run (--first-turn):
the place in the order moves a ratio by several percent here. Each run adds its rounds to --json
and rewrites the .md beside it from all rounds so far (ratios: median of the per-round ratios,
and of the medians), so a long measurement is several runs under ~10 minutes, each under the
benchmark lock:
  flock /work/notes/bench.lock python -m benchmarks.at_scale decode --rounds 3
  flock /work/notes/bench.lock python -m benchmarks.at_scale serve --rounds 6
OpenMP as users have it: refuses to run with OMP_WAIT_POLICY set.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

from benchmarks.harness import (
    QUIET,
    QUILL,
    RESULTS,
    TOOLS,
    chat_reply,
    command_line,
    interleave,
    machine_line,
    paired,
    quill_commit,
    refuse_omp_wait_policy,
    send_concurrently,
    served_model,
    serving,
    users_env,
)
from benchmarks.serve_load import PROMPTS

THRESHOLDS = {"pp512": 0.98, "tg128": 0.98, "serve": 0.97}  # issue 27's acceptance


def run_json(command: list[str], env: dict[str, str] | None = None) -> object:
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{shlex.join(command)[:300]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def fitted_prompt(tokenize: Callable[[str], list[int]], words: list[str], n: int, seed: int) -> str:
    """Text of random words that tokenizes to exactly n tokens (BOS included)."""
    rng = random.Random(seed)
    chosen = [rng.choice(words) for _ in range(n)]
    while (have := len(tokenize(" ".join(chosen)))) != n:
        if have > n:
            chosen = chosen[: -max(1, (have - n) // 2)]
        else:
            chosen.append(rng.choice(words))
    return " ".join(chosen)


def fresh_commands(args: argparse.Namespace, repack: bool, n_ctx: int) -> tuple[list, list, dict]:
    """`quill run` (before its -n and prompt) and llama-bench (before -p and -n) as a user runs
    them, with the same threads, batch, ubatch, flash attention, repacking and f16 KV; and the
    environment (a fresh QUILL_HOME, OpenMP as users have it)."""
    t = str(args.threads)
    home = tempfile.mkdtemp(prefix="quill-at-scale-")
    env = users_env(QUILL_HOME=home)
    run = [QUILL, "run", "-m", str(args.model), "--raw", "--temp", "0", "--ignore-eos", "--json",
           "-t", t, "-c", str(n_ctx)]  # fmt: skip
    bench = [str(TOOLS / "llama-bench"), "-m", str(args.model), "-t", t, "-r", "1",
             "-b", "512", "-ub", "512", "-fa", "auto", "--repack", "1" if repack else "0",
             "-o", "json"]  # fmt: skip
    return run, bench, env


def decode_rounds(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions
    from cli.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    p, n, t = 512, 128, str(args.threads)
    options = LoadOptions(n_ctx=p + n + 2, threads=args.threads)
    engine = Engine(args.model, options)
    repack = engine.cpu_path.label == "extra"
    words = [
        w for w in re.findall(r"[a-z]{3,9}", Path("/usr/share/common-licenses/GPL-3").read_text())
    ]
    rng = random.Random(0)
    run, bench, env = fresh_commands(args, repack, p + n + 2)
    bench += ["-p", str(p), "-n", str(n)]

    def quill_run_pp(round_: int) -> dict:
        # A distinct prompt each round: the automatic prompt cache (on, as users have it) misses.
        prompt = fitted_prompt(engine.tokenize, words, p, seed=round_ + 1000 * args.seed)
        out = run_json([*run, "-n", "1", prompt], env)
        assert out["prompt_tokens"] == p and out["cached_prompt_tokens"] == 0, out
        return {"pp512": out["prefill_tokens_per_s"]}

    def quill_run_tg(_round: int) -> dict:
        out = run_json([*run, "-n", str(n + 1), "Hi"], env)
        assert out["generation_tokens"] == n + 1, out
        return {"tg128": out["decode_tokens_per_s"], "prompt_tokens": out["prompt_tokens"]}

    def quill_engine(_round: int) -> dict:
        prompt = [rng.randrange(engine.n_vocab) for _ in range(p)]
        pp = next(iter(engine.stream_generate(prompt, 1, greedy))).prefill_tokens_per_s
        last = list(engine.stream_generate([rng.randrange(engine.n_vocab)], n + 1, greedy))[-1]
        return {"pp512": pp, "tg128": last.decode_tokens_per_s}

    def llama_bench(_round: int) -> dict:
        rows = run_json(bench, env)
        return {("pp512" if r["n_prompt"] else "tg128"): r["avg_ts"] for r in rows} | {
            "build": rows[0]["build_commit"]
        }

    contenders = {"quill run pp": quill_run_pp, "quill run tg": quill_run_tg,
                  "quill engine": quill_engine, "llama-bench": llama_bench}  # fmt: skip
    quill_engine(-1)  # warm-up: the first prefill and decode of a process are slower
    rounds = interleave(contenders, args.rounds, args.first_turn)
    engine.close()
    commands = {
        "quill run pp": shlex.join([*run, "-n", "1", "PROMPT"]) + "  # PROMPT: 512 tokens",
        "quill run tg": shlex.join([*run, "-n", str(n + 1), "Hi"]),
        "quill engine": f"Engine({args.model}, LoadOptions(n_ctx={p + n + 2}, threads={t})) "
        f"stream_generate: {p} random tokens, 1 token; 1 random token, {n + 1} tokens",
        "llama-bench": shlex.join(bench),
    }
    return rounds, {"commands": commands, "weight_repacking": repack}


def tg_rounds(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Decode alone, each tool in a fresh process doing only that: `quill run` on a 2-token
    prompt for 129 tokens against `llama-bench -p 0 -n 128` (its warm-up is one decode step),
    back to back, so that the host's drift over a round is seconds, not minutes."""
    from cli.engine.loading import amx_present

    n = 128
    repack = not amx_present()  # the CPU path `quill run` takes: llama.cpp's extra buffers
    # The decode part's context: a decode step reads the same KV cells.
    run, bench, env = fresh_commands(args, repack, 512 + n + 2)
    bench += ["-p", "0", "-n", str(n)]

    def quill_run(_round: int) -> dict:
        out = run_json([*run, "-n", str(n + 1), "Hi"], env)
        assert out["generation_tokens"] == n + 1, out
        return {"tg128": out["decode_tokens_per_s"], "prompt_tokens": out["prompt_tokens"]}

    def llama_bench(_round: int) -> dict:
        rows = run_json(bench, env)
        return {"tg128": rows[0]["avg_ts"], "build": rows[0]["build_commit"]}

    rounds = interleave(
        {"quill run": quill_run, "llama-bench": llama_bench}, args.rounds, args.first_turn
    )
    commands = {
        "quill run": shlex.join([*run, "-n", str(n + 1), "Hi"]),
        "llama-bench": shlex.join(bench),
    }
    return rounds, {"commands": commands, "weight_repacking": repack}


def overhead_rounds(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """llama-bench's own loops (test_prompt, test_gen: llama_decode on llama_batch_get_one, no
    sampling) run on quill's context, alternated with quill's engine every few seconds: what
    quill adds, with the host's drift (minutes long) cancelled."""
    import llama_cpp as llama

    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions
    from cli.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    p, n = 512, 128
    engine = Engine(args.model, LoadOptions(n_ctx=p + n + 2, threads=args.threads))
    ctx, rng = engine._ctx, random.Random(args.seed)  # the very context quill decodes on

    def decode(tokens: list[int]) -> None:
        array = (llama.llama_token * len(tokens))(*tokens)
        if llama.llama_decode(ctx, llama.llama_batch_get_one(array, len(tokens))) != 0:
            raise SystemExit("llama_decode failed")

    def llama_bench_loops(_round: int) -> dict:
        engine.clear_cache()
        started = time.perf_counter()
        decode([rng.randrange(engine.n_vocab) for _ in range(p)])
        llama.llama_synchronize(ctx)
        pp = p / (time.perf_counter() - started)
        engine.clear_cache()
        started, token = time.perf_counter(), rng.randrange(engine.n_vocab)
        for _ in range(n):
            decode([token])
            llama.llama_synchronize(ctx)
            token = rng.randrange(engine.n_vocab)
        tg = n / (time.perf_counter() - started)
        engine.clear_cache()
        return {"pp512": pp, "tg128": tg}

    def quill_engine(_round: int) -> dict:
        engine.clear_cache()
        prompt = [rng.randrange(engine.n_vocab) for _ in range(p)]
        pp = next(iter(engine.stream_generate(prompt, 1, greedy))).prefill_tokens_per_s
        last = list(engine.stream_generate([rng.randrange(engine.n_vocab)], n + 1, greedy))[-1]
        return {"pp512": pp, "tg128": last.decode_tokens_per_s}

    contenders = {"quill engine": quill_engine, "llama-bench loops": llama_bench_loops}
    quill_engine(-1)  # warm-up, as llama-bench warms up
    llama_bench_loops(-1)
    rounds = interleave(contenders, args.rounds, args.first_turn)
    engine.close()
    commands = {
        "quill engine": f"Engine({args.model}, LoadOptions(n_ctx={p + n + 2}, "
        f"threads={args.threads})) stream_generate: {p} random tokens, 1 token; 1 random "
        f"token, {n + 1} tokens (decode rate over the last {n})",
        "llama-bench loops": f"on the same context: llama_decode of {p} random tokens in one "
        f"llama_batch_get_one; {n} llama_decode calls of one random token (llama-bench's "
        "test_prompt and test_gen)",
    }
    return rounds, {"commands": commands, "weight_repacking": engine.cpu_path.label == "extra"}


def serve_rounds(args: argparse.Namespace) -> tuple[list[dict], dict]:
    from cli.engine.loading import amx_present

    # quill's CPU path off AMX is llama.cpp's extra buffers, which llama-server's default is too.
    repack = not amx_present()
    env = users_env(QUILL_HOME=tempfile.mkdtemp(prefix="quill-at-scale-"))
    np_, ctx, t = str(args.parallel), args.ctx, str(args.threads)
    quill = [QUILL, "serve", "-m", str(args.model), "-np", np_, "-c", str(ctx), "-t", t]
    server = [str(TOOLS / "llama-server"), "-m", str(args.model), "-np", np_,
              "-c", str(ctx * args.parallel), "-t", t, "-b", "512", "-ub", "512", "-fa", "auto",
              *([] if repack else ["--no-repack"])]  # fmt: skip

    def serve(command: list[str]) -> Callable[[int], dict]:
        def measure(_round: int) -> dict:
            with serving(command, env, stderr=subprocess.DEVNULL) as (_, url):
                model = served_model(url)
                chat_reply(url, "Warm up.", 8, model)
                replies, wall = send_concurrently(
                    url, model, args.parallel, args.requests, PROMPTS, args.max_tokens
                )
            return {"serve": sum(r.completion_tokens for r in replies) / wall,
                    "prompt_tokens": sum(r.prompt_tokens for r in replies)}  # fmt: skip

        return measure

    rounds = interleave(
        {"quill serve": serve(quill), "llama-server": serve(server)}, args.rounds, args.first_turn
    )
    commands = {
        "quill serve": shlex.join([*quill, "--port", "PORT"]),
        "llama-server": shlex.join([*server, "--port", "PORT"]),
        "clients": f"{args.parallel} threads, {args.requests} requests of {args.max_tokens} "
        "tokens, greedy, ignore_eos, stream, serve_load.py's 4 prompts in turn",
    }
    return rounds, {"commands": commands, "weight_repacking": repack}


PAIRS = {  # (part, test, quill's contender, the reference)
    "decode": [("pp512", "quill run pp", "llama-bench"), ("tg128", "quill run tg", "llama-bench"),
               ("pp512", "quill engine", "llama-bench"), ("tg128", "quill engine", "llama-bench")],
    "tg": [("tg128", "quill run", "llama-bench")],
    "serve": [("serve", "quill serve", "llama-server")],
    "overhead": [("pp512", "quill engine", "llama-bench loops"),
                 ("tg128", "quill engine", "llama-bench loops")],
}  # fmt: skip


def report(record: dict) -> str:
    lines = [f"# quill against llama.cpp at the scale users run ({record['date']})", "",
             f"{record['cpu']}; llama-cpp-python {record['llama_cpp_python']}; "
             "OpenMP's default wait policy; interleaved rounds. A pair is quiet when other "
             f"processes took under {QUIET:.0%} of one core beside each of its two measurements "
             "(measured from /proc/stat since the second run).", ""]  # fmt: skip
    for part, runs in record["parts"].items():
        rounds = [r for run in runs for r in run["rounds"]]
        first = runs[-1]
        lines += [f"## {part}: {Path(first['model']).name}", "",
                  f"{len(rounds)} rounds in {len(runs)} runs; weight repacking "
                  f"{'on' if first['weight_repacking'] else 'off'}. Commands:", ""]  # fmt: skip
        lines += [f"- {name}: `{command}`" for name, command in first["commands"].items()]
        lines += ["", "| test | quill | tok/s (median) | reference | tok/s (median) | per-round "
                  "ratio: median (min-max), all rounds | quiet pairs: n, median ratio | target |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for test, ours, theirs in PAIRS[part.split(",")[0]]:  # "serve, before X": a kept run
            ratio = paired(rounds, test, ours, theirs)
            lines.append(
                f"| {test} | {ours} | {ratio.ours:.2f} | {theirs} | {ratio.reference:.2f} | "
                f"{ratio.cells()} | {ratio.verdict(THRESHOLDS[test])} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["decode", "tg", "serve", "overhead"])
    parser.add_argument("--model", type=Path, help="default: the part's file in /work/shapes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=4, help="serve: slots and clients")
    parser.add_argument("--ctx", type=int, default=1024, help="serve: context per slot")
    parser.add_argument("--requests", type=int, default=16, help="serve: requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="serve: tokens per request")
    parser.add_argument("--seed", type=int, default=0, help="decode: prompt words (vary per run)")
    parser.add_argument(
        "--first-turn",
        type=int,
        help="the first round's order (default: go on from the rounds --json holds, so that short "
        "runs still give every contender every place in the order)",
    )
    parser.add_argument(
        "--json", type=Path, default=RESULTS / f"at-scale-{time.strftime('%Y-%m-%d')}.json"
    )
    args = parser.parse_args()
    refuse_omp_wait_policy()
    shapes = Path("/work/shapes")
    args.model = args.model or shapes / {
        "decode": "llama-3-8b-shape.Q4_K_M.gguf", "serve": "llama-3.2-1b-shape.Q4_K_M.gguf",
        "overhead": "llama-3-8b-shape.Q4_K_M.gguf", "tg": "llama-3-8b-shape.Q4_K_M.gguf",
    }[args.part]  # fmt: skip
    measure = {
        "decode": decode_rounds,
        "tg": tg_rounds,
        "serve": serve_rounds,
        "overhead": overhead_rounds,
    }[args.part]
    record = (
        json.loads(args.json.read_text())
        if args.json.exists()
        else {"date": time.strftime("%Y-%m-%d"), "cpu": machine_line(),
              "llama_cpp_python": version("llama-cpp-python"), "parts": {}}
    )  # fmt: skip
    # Ratios from two machines do not pool: each file holds one machine's rounds.
    if record["cpu"] != machine_line():
        raise SystemExit(f"{args.json} holds rounds from {record['cpu']}, not {machine_line()}: "
                         "pass --json with another file")  # fmt: skip
    if args.first_turn is None:
        args.first_turn = sum(len(run["rounds"]) for run in record["parts"].get(args.part, []))
    started, clock = time.strftime("%Y-%m-%dT%H:%M:%S"), time.perf_counter()
    commit = quill_commit()  # the code measured: taken before, as the tree may change meanwhile
    rounds, facts = measure(args)
    run = {"started": started, "seconds": round(time.perf_counter() - clock), **facts,
           "model": str(args.model), "threads": args.threads,
           "command": command_line("benchmarks.at_scale"), "commit": commit,
           "rounds": rounds}  # fmt: skip
    record["parts"].setdefault(args.part, []).append(run)
    args.json.write_text(json.dumps(record, indent=1))
    args.json.with_suffix(".md").write_text(report(record))
    print(report(record))


if __name__ == "__main__":
    main()

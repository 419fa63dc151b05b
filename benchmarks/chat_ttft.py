"""Time to first token, turn by turn, in a chat: with the KV prefix cache and without it.

Usage (inside quill's venv): python -m benchmarks.chat_ttft [--turns 10] [--model smollm2-135m]

Both runs send the same ten messages with greedy sampling, so the histories are identical. "cached"
is quill chat as it runs; "no cache" clears the KV cache before each turn, which is what a tool
that re-sends the whole conversation without prefix reuse pays. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from cli.engine.chatsession import ChatSession, ChatSettings, TurnStart
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.store.models import obtain, parse_model_name
from cli.store.registry import load_registry

MESSAGE = "Tell me one more short fact about the sea."


def run(engine: Engine, turns: int, reuse: bool) -> list[tuple[float, int, int]]:
    session = ChatSession(
        engine, "bench", None, "Answer in one sentence.",
        ChatSettings(sampling=SamplingParams(temperature=0), max_tokens=48),
    )  # fmt: skip
    engine.clear_cache()  # every run starts as a new chat
    rows = []
    for _ in range(turns):
        if not reuse:
            engine.clear_cache()
        started = time.perf_counter()
        ttft = None
        for item in session.send(MESSAGE):
            if isinstance(item, TurnStart):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
                first = item
        rows.append((ttft or 0.0, first.prompt_tokens - first.cached_prompt_tokens,
                     first.cached_prompt_tokens))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = obtain(parse_model_name(args.model, load_registry()))
    with Engine(path, LoadOptions(n_ctx=4096)) as engine:
        run(engine, 2, True)  # warm-up
        cached = [run(engine, args.turns, True) for _ in range(args.rounds)]
        fresh = [run(engine, args.turns, False) for _ in range(args.rounds)]
    print("| turn | cached: new tokens | cached: reused | cached: TTFT ms | no cache: prefilled "
          "| no cache: TTFT ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for turn in range(args.turns):
        ttft_cached = statistics.median(r[turn][0] for r in cached) * 1000
        ttft_fresh = statistics.median(r[turn][0] for r in fresh) * 1000
        _, new, reused = cached[0][turn]
        _, prefilled, _ = fresh[0][turn]
        print(f"| {turn + 1} | {new} | {reused} | {ttft_cached:.0f} | {prefilled} | "
              f"{ttft_fresh:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()

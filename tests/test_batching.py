"""What continuous batching may and may not change: a sequence's logits against the same
sequence decoded alone, and the scheduler's outputs against single runs."""

from __future__ import annotations

import numpy as np

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

import threadcount
from neartie import assert_near_tokens
from reference import Reference

PROMPTS = ("The capital of France is Paris, and the capital of Italy is",
           "Once upon a time there was a dragon who")  # fmt: skip


def decode(engine: Engine, items: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
    """One decode of (sequence, token, position, wants logits); logits per sequence."""
    for seq, _, position, _ in items[:1]:
        assert position == engine.cached_count(seq)
    outputs = engine.decode([(seq, token, wants) for seq, token, _, wants in items])
    return {
        seq: engine.output_logits(output)
        for (seq, _, _, _), output in zip(items, outputs, strict=True)
        if output >= 0
    }


def last_step(engine: Engine, a: list[int], b: list[int], with_other: bool) -> np.ndarray:
    """A's final token decoded alone, or in the same step as B's final token."""
    engine.clear_cache()
    decode(engine, [(0, t, i, False) for i, t in enumerate(a[:-1])]
                   + [(1, t, i, False) for i, t in enumerate(b[:-1])])  # fmt: skip
    step = [(0, a[-1], len(a) - 1, True)]
    if with_other:
        step.append((1, b[-1], len(b) - 1, True))
    return decode(engine, step)[0]


def test_a_sequences_logits_do_not_depend_on_its_batch_mates(smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=256, parallel=2)) as engine:
        a, b = (engine.tokenize(p) for p in PROMPTS)
        alone = last_step(engine, a, b, with_other=False)
        shared = last_step(engine, a, b, with_other=True)
    difference = float(np.abs(alone - shared).max())
    # Measured 0.0 on this CPU build. A backend whose kernels depend on the batch may differ a
    # little; then a greedy pick may flip only where the two best logits are that close.
    assert difference < 1e-2
    if alone.argmax() != shared.argmax():
        best_two = np.sort(alone)[-2:]
        assert best_two[1] - best_two[0] <= 2 * difference


def test_scheduler_greedy_outputs_equal_single_runs(smollm2_path):
    """Each reply, alone or batched with others, is this machine's greedy reply (up to near-ties:
    a batch of three rows may sum in another order than a batch of one)."""
    greedy = SamplingParams(temperature=0)
    with Engine(smollm2_path, LoadOptions(n_ctx=256, parallel=3)) as engine:
        prompts = [engine.tokenize(p) for p in (*PROMPTS, "def fibonacci(n):")]
        single = [list(engine.stream_generate(p, 16, greedy)) for p in prompts]
        scheduler = BatchScheduler(engine)
        try:
            requests = [scheduler.submit(BatchRequest(p, 16, greedy)) for p in prompts]
            batched = [list(r.stream()) for r in requests]
            assert scheduler.max_sequences_in_a_step == 3
        finally:
            scheduler.close()
    reference = Reference(smollm2_path, n_ctx=256)
    try:
        for prompt, one, many in zip(prompts, single, batched, strict=True):
            assert_near_tokens(reference, prompt, [e.token for e in one], [e.token for e in many])
            for events in (one, many):
                ended = reference.is_eog(events[-1].token)
                assert events[-1].finish_reason == ("stop" if ended else "length")
    finally:
        reference.close()


@threadcount.needs_proc
def test_idle_schedulers_leave_no_compute_threads_and_wake_on_the_next_request(tiny_path):
    # Two models loaded in one server, each with its scheduler thread: OpenMP gives each thread
    # that computes a team of workers, and while the teams outnumber the cores every barrier
    # sleeps, slowing the busy model for as long as the idle one stays loaded. An idle scheduler
    # ends its thread (and team); a request starts it again. In a fresh process: the threads
    # come back to what they were before the schedulers, and both still answer.
    script = f"""
from pathlib import Path
import llama_cpp
from threadcount import settle, threads
from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

llama_cpp.llama_backend_init()
greedy = SamplingParams(temperature=0)
before = threads()
engines = [Engine(Path({str(tiny_path)!r}), LoadOptions(n_ctx=64, threads=2)) for _ in range(2)]
schedulers = [BatchScheduler(engine, idle_exit_s=0.3) for engine in engines]
for round_ in range(2):
    replies = [s.submit(BatchRequest([1, 2, 3], 4, greedy)) for s in schedulers]
    tokens = [[e.token for e in r.stream()] for r in replies]
    assert all(len(t) == 4 for t in tokens), tokens
    assert all(s.alive for s in schedulers)
    print(before, settle(before))
for s in schedulers:
    s.close()
"""
    counts = threadcount.run(script)
    assert len(counts) == 2
    for before, after in counts:
        assert after == before

"""Speculative decoding (cli/engine/speculative.py): greedy output with speculation is the plain
greedy output, token for token, on SmolLM2 and the tiny model, templated and raw, with stop
strings, at max_tokens boundaries, across chat turns and with a q8_0 KV cache; a draft model of
another vocabulary is refused; seeded sampling keeps its distribution (a chi-square test).

Speculation verifies k+1 tokens in one batch where plain decoding feeds one, and llama.cpp's
kernels may sum a batch in another order: where two tokens are nearly tied, the pick can flip.
So a difference is accepted only where the reference decoder confirms every speculated token by
teacher forcing (tests/neartie.py), which no real bug in acceptance or in the KV cache passes.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.speculative import (
    DraftModelDrafter,
    NgramDrafter,
    SpecOptions,
    WouldBeCheck,
    attach,
)

from neartie import assert_near, assert_near_tokens
from reference import Reference
from tinymodel import write_tiny_llama

GREEDY = SamplingParams(temperature=0.0)
DOCUMENT = (Path(__file__).parent / "data" / "gpl-3.txt").read_text(encoding="utf-8")[:900]
COPY = f"Repeat this text exactly:\n\n{DOCUMENT}"


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path) -> Iterator[Engine]:
    with Engine(smollm2_path, LoadOptions(threads=2, n_ctx=2048)) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny(tiny_path: Path) -> Iterator[Engine]:
    with Engine(tiny_path, LoadOptions(threads=1, n_ctx=2048)) as engine:
        yield engine


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path: Path) -> Iterator[Reference]:
    reference = Reference(smollm2_path, threads=2)
    yield reference
    reference.close()


@pytest.fixture(scope="module")
def tiny_reference(tiny_path: Path) -> Iterator[Reference]:
    reference = Reference(tiny_path, n_ctx=2048, threads=1)
    yield reference
    reference.close()


def draft_for(engine: Engine, path: Path) -> Engine:
    return Engine(path, LoadOptions(threads=2, n_ctx=engine.n_ctx))


@contextmanager
def speculating(engine: Engine, options: SpecOptions, draft: Engine | None = None):
    attach(engine, options, draft)
    try:
        yield engine.speculator
    finally:
        attach(engine, SpecOptions("off"))


def generate(engine: Engine, text: str, n: int, stop: Sequence[str] = (), raw: bool = False):
    """(tokens, text, last event) of a reply from a cold cache: both runs prefill alike."""
    engine.clear_cache()
    if raw:
        events = list(engine.stream_text(text, n, GREEDY, stop))
    else:
        events = list(engine.stream_chat([("user", text)], n, GREEDY, stop))
    return [e.token for e in events], "".join(e.text for e in events), events[-1]


def prompt_tokens(engine: Engine, text: str, raw: bool) -> list[int]:
    return engine.tokenize(text if raw else engine.conversation_text([("user", text)])[0])


MODES = [
    pytest.param("ngram", None, id="ngram-adaptive"),
    pytest.param("ngram", 6, id="ngram-k6"),
    pytest.param("draft", 3, id="draft-self-k3"),
    pytest.param("draft-tiny", 4, id="draft-tiny-k4"),
]


@pytest.fixture(scope="module")
def plain_replies(smollm2: Engine) -> dict[bool, tuple[list[int], str]]:
    """(tokens, text) of the plain greedy reply to COPY, templated (False) and raw (True): each
    mode compares with the same one."""
    return {raw: generate(smollm2, COPY, 96, raw=raw)[:2] for raw in (False, True)}


# Every mode on a templated prompt; a raw one (no chat template: another prompt, the same
# verify loop) through the adaptive lookup only, since the modes share that loop.
CASES = [
    *(pytest.param(*mode.values, False, id=f"{mode.id}-templated") for mode in MODES),
    pytest.param("ngram", None, True, id="ngram-adaptive-raw"),
]


@pytest.mark.parametrize(("mode", "k", "raw"), CASES)
def test_smollm2_greedy_is_plain_greedy(
    smollm2, smollm2_path, tiny_smollm2_vocab_path, smollm2_reference, plain_replies, mode, k, raw
):
    plain, plain_text = plain_replies[raw]
    draft = None
    if mode == "draft":
        draft = draft_for(smollm2, smollm2_path)  # the model itself: guesses mostly hold
    elif mode == "draft-tiny":
        # random weights (with SmolLM2's vocabulary): guesses mostly fail
        draft = draft_for(smollm2, tiny_smollm2_vocab_path)
    with speculating(smollm2, SpecOptions(mode.split("-")[0], k), draft) as speculator:
        tokens, text, last = generate(smollm2, COPY, 96, raw=raw)
        stats = speculator.last_stats
    prompt = prompt_tokens(smollm2, COPY, raw)
    assert_near_tokens(smollm2_reference, prompt, plain, tokens)
    assert last.generation_tokens == len(tokens) <= 96
    assert stats.drafted > 0 and stats.verify_steps > 0  # speculation really ran
    assert stats.accepted <= stats.drafted
    if mode == "draft":
        assert stats.accepted > stats.drafted // 2  # the model agrees with itself
    # same path: each reply's streamed text is its own tokens' pieces (the tokens are checked)
    assert (plain_text, text) == (smollm2_reference.text(plain), smollm2_reference.text(tokens))


@pytest.mark.parametrize("raw", [False, True], ids=["templated", "raw"])
@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_tiny_greedy_is_plain_greedy(tiny, tiny_path, tiny_reference, mode, raw):
    # Random weights seldom repeat: prompt lookup's guesses fail (the rejection path), while
    # the model drafting for itself is mostly right (the acceptance path).
    plain, _, _ = generate(tiny, COPY, 120, raw=raw)
    draft = draft_for(tiny, tiny_path) if mode == "draft" else None
    with speculating(tiny, SpecOptions(mode, 5), draft) as speculator:
        tokens, _, _ = generate(tiny, COPY, 120, raw=raw)
        stats = speculator.last_stats
    assert_near_tokens(tiny_reference, prompt_tokens(tiny, COPY, raw), plain, tokens)
    assert stats.drafted > 0
    if mode == "draft":
        assert stats.accepted > stats.drafted // 2


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_max_tokens_is_never_passed(tiny, tiny_reference, n):
    """k=8 guesses would run past small limits; the limit trims them."""
    plain, plain_text, _ = generate(tiny, COPY, n, raw=True)
    with speculating(tiny, SpecOptions("ngram", 8)):
        tokens, text, last = generate(tiny, COPY, n, raw=True)
        after = tiny.cached()
    prompt = prompt_tokens(tiny, COPY, raw=True)
    assert_near_tokens(tiny_reference, prompt, plain, tokens)
    assert_near(tiny_reference, prompt, plain_text, text)
    assert len(tokens) == last.generation_tokens <= n
    # The cache holds what plain decoding leaves: the prompt and every token but the last.
    assert after == prompt + tokens[:-1]


def test_stop_strings_end_where_plain_ends(smollm2, smollm2_reference):
    _, plain_text, _ = generate(smollm2, COPY, 80)
    words = plain_text.split()
    assert len(words) > 12, plain_text
    stop = " ".join(words[8:10])  # a stop string from the middle of the plain reply
    _, expected_text, expected_last = generate(smollm2, COPY, 80, stop=[stop])
    with speculating(smollm2, SpecOptions("ngram", 8)):
        tokens, text, last = generate(smollm2, COPY, 80, stop=[stop])
        after = smollm2.cached()
    prompt = prompt_tokens(smollm2, COPY, raw=False)
    assert_near(smollm2_reference, prompt, expected_text, text)
    assert expected_last.finish_reason == "stop" and stop not in text
    # Where a near-tie took speculation another way before the stop string, it may never come.
    assert last.finish_reason in ("stop", "length")
    if last.finish_reason == "stop":
        assert last.stop_string == stop
    assert after == prompt + tokens[:-1]


def test_end_of_generation_ends_the_reply(smollm2, smollm2_reference):
    question = "What is the capital of France? One word."
    plain, _, plain_last = generate(smollm2, question, 64)
    with speculating(smollm2, SpecOptions("draft", 4), draft_for(smollm2, smollm2.path)):
        tokens, _, last = generate(smollm2, question, 64)
    assert plain_last.finish_reason == "stop" and smollm2.is_end_of_generation(plain[-1])
    prompt = prompt_tokens(smollm2, question, raw=False)
    assert_near_tokens(smollm2_reference, prompt, plain, tokens)
    assert smollm2.is_end_of_generation(tokens[-1]) and last.finish_reason == "stop"


def test_q8_0_kv_cache(smollm2_path, smollm2_reference):
    options = LoadOptions(threads=2, n_ctx=2048, kv_type_k="q8_0", kv_type_v="q8_0")
    with Engine(smollm2_path, options) as engine:
        plain, _, _ = generate(engine, COPY, 64)
        with speculating(engine, SpecOptions("ngram", 6)) as speculator:
            tokens, _, _ = generate(engine, COPY, 64)
            assert speculator.last_stats.drafted > 0
        prompt = prompt_tokens(engine, COPY, raw=False)
    reference = Reference(smollm2_path, threads=2, kv_type="q8_0")
    try:
        assert_near_tokens(reference, prompt, plain, tokens)
    finally:
        reference.close()


def test_chat_turns_reuse_the_cache_and_match_plain(
    runner, smollm2_path, smollm2_reference, tmp_path
):
    """Three turns through quill chat, speculating and not: the same replies, and the later
    turns prefill only what is new (the speculative turns left no stray cells behind)."""
    lines = "Count from 1 to 12.\nNow count down from 12 to 1.\nSay the first line again.\n"

    def chat(*extra: str) -> tuple[list[str], str]:
        transcript = tmp_path / f"chat{len(extra)}.json"
        args = ["chat", "--temperature", "0", "-n", "60", "--transcript", str(transcript)]
        result = runner.invoke(app, [*args, *extra], input=lines)
        assert result.exit_code == 0, result.stderr
        saved = json.loads(transcript.read_text(encoding="utf-8"))
        return [m["content"] for m in saved["messages"] if m["role"] == "assistant"], result.stderr

    plain, _ = chat()
    speculated, stderr = chat("--spec", "ngram", "--draft-tokens", "4")
    assert len(plain) == len(speculated) == 3
    for replies in (plain, speculated):  # each turn after that run's own history
        turns: list[tuple[str, str]] = []
        for line, reply in zip(lines.splitlines(), replies, strict=True):
            turns.append(("user", line))
            prompt = smollm2_reference.tokenize(smollm2_reference.chat(turns), add_special=True)
            assert_near(smollm2_reference, prompt, reply)
            turns.append(("assistant", reply))
    assert stderr.count("spec ngram accepted") == 3
    cached = [int(c) for c in re.findall(r"\((\d+) cached\)", stderr)]
    assert len(cached) == 3 and cached[1] > 0 and cached[2] > cached[1]


def test_run_cli_json_reports_speculation(runner, smollm2_path, smollm2_reference):
    args = ["run", "--json", "--temperature", "0", "-n", "48", "--raw", COPY]
    plain = json.loads(runner.invoke(app, args).stdout)
    result = runner.invoke(app, [*args, "--spec", "ngram", "--draft-tokens", "3"])
    assert result.exit_code == 0, result.stderr
    speculated = json.loads(result.stdout)
    spec = speculated["speculation"]
    assert plain["speculation"] is None
    prompt = smollm2_reference.tokenize(COPY, add_special=True)
    assert_near(smollm2_reference, prompt, plain["text"], speculated["text"])
    assert spec["mode"] == "ngram" and 0 < spec["drafted"] <= 3 * spec["verify_steps"]
    assert spec["acceptance_rate"] == spec["accepted"] / spec["drafted"]
    # --draft-tokens fixes k and never pauses: the documented keys say so.
    assert (spec["first_paused_at"], spec["pauses"], spec["watched"]) == (None, 0, 0)


def test_run_cli_draft_model_stats_line(runner, smollm2_path, smollm2_reference):
    args = ["run", "--temperature", "0", "-n", "24", "Name three colors."]
    plain = runner.invoke(app, args)
    result = runner.invoke(app, [*args, "--spec", "draft", "--draft", str(smollm2_path)])
    assert result.exit_code == 0, result.stderr
    prompt = smollm2_reference.tokenize(
        smollm2_reference.chat([("user", "Name three colors.")]), add_special=True
    )
    assert_near(smollm2_reference, prompt, plain.stdout.rstrip("\n"), result.stdout.rstrip("\n"))
    assert "spec draft accepted" in result.stderr


def pairs_sampled(engine: Engine, prompt: list[int], seeds: range, temperature: float = 1.0):
    """How often each (first, second) token pair comes out over many seeds. With a limit of
    3 tokens the second token is the one a guess is tested for (the first comes from the
    prefill), so it is where a wrong acceptance rule would show."""
    counts: Counter[tuple[int, int]] = Counter()
    for seed in seeds:
        sampling = SamplingParams(temperature=temperature, top_k=6, top_p=1.0, min_p=0.0, seed=seed)
        tokens = [event.token for event in engine.stream_generate(prompt, 3, sampling)]
        counts[(tokens[0], tokens[1])] += 1
    return counts


def same_distribution(a: Counter, b: Counter) -> tuple[bool, float, float]:
    """Chi-square test of homogeneity for two samples of equal size, pairs seen fewer than 10
    times pooled; (passes at significance 0.001, statistic, critical value by Wilson-Hilferty)."""
    statistic, df, pooled_a, pooled_b = 0.0, -1, 0, 0
    for key in set(a) | set(b):
        x, y = a[key], b[key]
        if x + y < 10:
            pooled_a, pooled_b = pooled_a + x, pooled_b + y
            continue
        statistic, df = statistic + (x - y) ** 2 / (x + y), df + 1
    if pooled_a + pooled_b:
        statistic += (pooled_a - pooled_b) ** 2 / (pooled_a + pooled_b)
        df += 1
    z = 3.09  # the standard normal's 0.999 quantile
    critical = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return statistic < critical, statistic, critical


def test_sampling_with_speculation_keeps_the_distribution(tiny, tiny_path):
    """Seeded sampling (temperature 1, top-k 6) over 1500 seeds with and without a draft model:
    the pairs of first and second tokens must pass a chi-square test of one distribution (at
    0.001, a false alarm once in a thousand runs). A control shows the test has the power to
    see the usual mistake, a rule that leans toward the guess (the draft's greedy pick): plain
    sampling at temperature 0.3, which leans toward the greedy pick too, must fail it."""
    prompt = tiny.tokenize("The quick brown fox")
    seeds = 1500
    plain = pairs_sampled(tiny, prompt, range(1, 1 + seeds))
    colder = pairs_sampled(tiny, prompt, range(200_000, 200_000 + seeds), temperature=0.3)
    accepted = drafted = 0
    with speculating(tiny, SpecOptions("draft", 2), draft_for(tiny, tiny_path)) as speculator:
        speculated: Counter[tuple[int, int]] = Counter()
        for seed in range(100_000, 100_000 + seeds):
            speculated += pairs_sampled(tiny, prompt, range(seed, seed + 1))
            accepted += speculator.last_stats.accepted
            drafted += speculator.last_stats.drafted
    assert drafted == seeds and 0 < accepted < drafted  # each reply tested one guess
    passes, statistic, critical = same_distribution(plain, speculated)
    assert passes, f"chi-square {statistic:.1f} >= {critical:.1f}: the distribution changed"
    control, statistic, critical = same_distribution(plain, colder)
    assert not control, f"the test cannot see temperature 0.3 ({statistic:.1f} < {critical:.1f})"


def test_seeded_sampling_with_speculation_repeats(runner, smollm2_path):
    args = ["run", "--json", "--temperature", "0.8", "--seed", "7", "-n", "32", "--raw", COPY]
    args += ["--spec", "ngram", "--draft-tokens", "4", "-t", "1"]
    first, second = (json.loads(runner.invoke(app, args).stdout) for _ in range(2))
    assert first["text"] == second["text"]  # same path: one command, run twice
    assert first["speculation"]["drafted"] > 0


def test_draft_of_another_vocabulary_is_refused(runner, smollm2_path, tmp_path):
    other = write_tiny_llama(tmp_path / "other.gguf", smollm2_path, reverse_tokens_from=1000)
    result = runner.invoke(
        app, ["run", "--temperature", "0", "--spec", "draft", "--draft", str(other), "Hi"]
    )
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "another vocabulary" in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--spec", "fast"], "--spec takes"),
        (["--draft", "x.gguf"], "add --spec draft"),
        (["--spec", "draft"], "needs --draft"),
        (["--draft-tokens", "4"], "add --spec"),
        (["--spec", "ngram", "--endpoint", "http://127.0.0.1:9/v1"], "local model"),
    ],
)
def test_contradictory_flags_are_refused(runner, args, says):
    result = runner.invoke(app, ["run", *args, "Hi"])
    assert result.exit_code == 2 and says in result.stderr


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter(longest=3, shortest=2)
    history = [5, 1, 2, 3, 4, 9, 1, 2, 3, 7, 8, 1, 2]
    # "1 2" last ended before 3 (at index 7..8): the latest occurrence wins.
    assert drafter.propose(history, 3) == [3, 7, 8]
    assert drafter.propose([*history, 3], 2) == [7, 8]
    assert drafter.propose([6, 6, 0], 4) == []  # a new reply: nothing matches


def test_bench_rows_per_speculation_mode(runner, tiny_path):
    grid = ["-p", "0", "-n", "24", "-r", "1", "-t", "1", "--json"]
    spec = ["--spec", "off,ngram,draft", "--draft", str(tiny_path), "--draft-tokens", "3"]
    result = runner.invoke(app, ["bench", str(tiny_path), *grid, *spec])
    assert result.exit_code == 0, result.stderr
    rows = {row["test"]: row for row in json.loads(result.stdout)["rows"]}
    assert set(rows) == {"tg24", "tg24+ngram", "tg24+draft"}
    assert rows["tg24"]["acceptance_rate"] is None
    assert 0.5 < rows["tg24+draft"]["acceptance_rate"] <= 1  # the model drafting for itself
    assert all(row["tokens_per_s"] > 0 for row in rows.values())


def test_timeline_marks_the_accepted_guesses(runner, smollm2_path):
    args = ["run", "--temperature", "0", "-n", "40", "--raw", "--timeline", COPY]
    result = runner.invoke(app, [*args, "--spec", "ngram", "--draft-tokens", "4"])
    assert result.exit_code == 0, result.stderr
    accepted = int(re.search(r"spec ngram accepted (\d+)/", result.stderr).group(1))
    marked = re.findall(r"^\s+\d+\+ ", result.stderr, flags=re.MULTILINE)
    rows = re.findall(r"^\s+\d+[+ ] ", result.stderr, flags=re.MULTILINE)
    assert accepted > 0 and len(marked) == accepted and len(rows) == 40


def test_verbose_memory_plan_counts_the_draft_model(runner, tiny_path):
    args = ["run", "-m", str(tiny_path), "--temperature", "0", "-n", "4", "--raw", "--verbose"]
    result = runner.invoke(app, [*args, "--spec", "draft", "--draft", str(tiny_path), "Hi"])
    assert result.exit_code == 0, result.stderr
    plans = [line for line in result.stderr.splitlines() if "memory plan at" in line]
    assert len(plans) == 2 and plans[1].startswith("draft ")
    # The same file with the same context: the draft's plan is the model's own.
    assert plans[1].split(": ", 1)[1] == plans[0]


def test_spec_under_a_schema_says_it_is_off(runner, smollm2_path, tiny_path):
    """A grammar judges each token before the next is guessed: --spec is turned off in one
    line, no draft model is loaded, and the reply is the one without --spec."""
    args = ["run", "--temperature", "0", "-n", "40", "-t", "1", "--format", "json", "A point"]
    plain = runner.invoke(app, args)
    for spec in (["--spec", "ngram"], ["--spec", "draft", "--draft", str(tiny_path)]):
        result = runner.invoke(app, [*args, *spec, "--json"])
        assert result.exit_code == plain.exit_code, result.stderr
        # same path: speculation is off, so both decode one token at a time alike
        assert json.loads(result.stdout)["text"] + "\n" == plain.stdout
        assert json.loads(result.stdout)["speculation"] is None
        warning = [line for line in result.stderr.splitlines() if "is off under" in line]
        assert warning == [f"quill: warning: --spec {spec[1]} is off under --schema, --format or "
                           "--grammar: the grammar must judge each token before the next is "
                           "guessed, so the reply decodes one token at a time"]  # fmt: skip
    chat = runner.invoke(
        app, ["chat", "-n", "8", "--format", "json", "--spec", "ngram"], input="hi\n"
    )
    assert chat.exit_code == 0 and "--spec ngram is off under" in chat.stderr


class FixedGuesses:
    """A free drafter that always guesses the same tokens."""

    free = True

    def __init__(self, guesses: list[int]) -> None:
        self.guesses = guesses

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        return self.guesses[:k]


def test_gated_policy_pauses_on_empty_checks_and_resumes_on_a_held_would_be_check():
    """The default policy checks k guesses (never past room); EMPTY_CHECKS checks in a row that
    held nothing pause it; while paused a free drafter's would-be checks are followed, and one
    that would hold RESUME_HELD guesses resumes it. A draft model's pause is timed and doubles;
    ungated (--draft-tokens K) it never pauses."""
    from cli.engine import speculative as spec
    from cli.engine.speculative import GatedPolicy, SpecStats

    EMPTY_CHECKS, FIRST_PAUSE, RESUME_HELD = spec.EMPTY_CHECKS, spec.FIRST_PAUSE, spec.RESUME_HELD

    drafter = FixedGuesses([7, 8, 9])
    stats = SpecStats("ngram")
    policy = GatedPolicy(stats, 3, free=True)
    assert policy.draft(drafter, [1], 1, room=2) == [7, 8]
    policy.observe(3, 8, guesses=2, held=1)
    for generated in range(4, 4 + EMPTY_CHECKS):
        assert policy.draft(drafter, [1], generated - 1, room=9) == [7, 8, 9]
        policy.observe(generated, 5, guesses=3, held=0)
    paused_at = 3 + EMPTY_CHECKS
    assert (stats.pauses, stats.first_paused_at) == (1, paused_at)
    # Paused: plain steps; the guesses are followed as would-be checks.
    assert policy.draft(drafter, [1], paused_at, room=9) == []
    policy.observe(paused_at + 1, 4, guesses=0, held=0)  # the first guess missed: held 0
    assert stats.watched == 1 and policy.draft(drafter, [1], paused_at + 1, room=9) == []
    assert RESUME_HELD == 2  # the next would-be check holds 7 and 8, then misses
    for n, token in enumerate([7, 8, 4], start=2):
        policy.observe(paused_at + n, token, guesses=0, held=0)
    assert stats.watched == 2
    assert policy.draft(drafter, [1], paused_at + 4, room=9) == [7, 8, 9]  # resumed

    model = GatedPolicy(SpecStats("draft"), 2, free=False)
    for pause in (FIRST_PAUSE, 2 * FIRST_PAUSE):
        for _ in range(EMPTY_CHECKS):
            model.observe(10, 5, guesses=2, held=0)
        assert model.draft(drafter, [1], 10 + pause - 1, room=9) == []
        assert model.draft(drafter, [1], 10 + pause, room=9) == [7, 8]
    assert model.stats.pauses == 2 and model.stats.watched == 0

    ungated = GatedPolicy(SpecStats("ngram"), 3, free=True, gated=False)
    for generated in range(10 * EMPTY_CHECKS):
        ungated.observe(generated, 5, guesses=3, held=0)
    assert ungated.draft(drafter, [1], 99, room=9) == [7, 8, 9] and ungated.stats.pauses == 0


def test_a_draft_model_guesses_only_while_it_is_sure(tiny, tiny_path):
    """A draft model stops guessing where its own top token is less likely than its floor
    (llama.cpp's p_min): a floor just above the first guess's probability gives no guess, one
    just below gives that guess; a floor of 0 gives all k."""
    prompt = tiny.tokenize("The quick brown fox")
    with draft_for(tiny, tiny_path) as draft:
        guesses = DraftModelDrafter(draft, p_min=0.0).propose(prompt, 4)
        assert len(guesses) == 4
        draft.keep_prefix(0, 0)
        last = len(prompt) - 1
        output = draft.decode([(0, token, i == last) for i, token in enumerate(prompt)])[0]
        logits = draft.output_logits(output).astype(np.float64)
        sure = 1.0 / np.exp(logits - logits.max()).sum()  # the top token's probability
        assert DraftModelDrafter(draft, p_min=sure * 1.01).propose(prompt, 4) == []
        assert DraftModelDrafter(draft, p_min=sure * 0.99).propose(prompt, 4)[:1] == guesses[:1]


def test_default_speculation_may_pause_and_keeps_the_text(tiny_path, tiny_reference):
    """Over 300 tokens of the tiny model the default policy speculates, may pause and resume;
    the text is plain greedy's throughout."""
    with Engine(tiny_path, LoadOptions(n_ctx=1024, threads=1)) as engine:
        prompt = engine.tokenize("a b c a b c a b c d e f d e f " * 6)
        plain = [
            e.token for e in engine.stream_generate(prompt, 300, SamplingParams(temperature=0))
        ]
        attach(engine, SpecOptions("ngram"))
        events = list(engine.stream_generate(prompt, 300, SamplingParams(temperature=0)))
        stats = engine.speculator.last_stats
    assert_near_tokens(tiny_reference, prompt, plain, [e.token for e in events])
    assert stats.verify_steps > 0
    # Pausing depends on which guesses hold; either way the record is consistent.
    assert (stats.pauses == 0) == (stats.first_paused_at is None)


def test_speculative_bound_is_the_cheapest_path_over_held_guesses():
    """benchmarks/speculative_bound.py's bound: each position a plain step or a check of up to
    the guesses that hold there, the cheapest way through the reply."""
    from benchmarks.speculative_bound import bound

    cost = {1: 1.0, 2: 1.5, 3: 1.8, 4: 2.0}
    # Five tokens, four steps. From the first, three guesses hold: one check of 4 positions
    # (cost 2.0) reaches the end, against 4.0 for plain steps.
    assert bound([3, 2, 1, 0, 0], cost) == pytest.approx(2.0)
    assert bound([0, 0, 0, 0, 0], cost) == 1.0  # nothing holds: plain steps
    # Batches that cost as much as their positions decoded one by one never pay.
    assert bound([3, 2, 1, 0, 0], {n: float(n) for n in range(1, 5)}) == 1.0
    # One guess holds at the second position: a check of 2 (1.5) for two steps (2.0).
    assert bound([0, 1, 0, 0, 0], cost) == pytest.approx(4.0 / 3.5)


def test_would_be_check_settles_as_a_check_would():
    """A would-be check settles at its first miss (held: the guesses before it) or when every
    guess held; until then it waits for the next token."""
    check = WouldBeCheck(generated=10, guesses=[5, 6, 7])
    assert check.settle(11, 5) is None
    assert check.settle(12, 6) is None
    assert check.settle(13, 7) == 3
    assert WouldBeCheck(10, [5, 6, 7]).settle(11, 9) == 0
    missed_second = WouldBeCheck(10, [5, 6, 7])
    assert missed_second.settle(11, 5) is None
    assert missed_second.settle(12, 8) == 1


class ScriptedDrafter:
    """A free drafter that knows the reply: wrong guesses before token `right_from` of the reply,
    the reply's own tokens from there on (what a copied passage looks like to prompt lookup)."""

    free = True

    def __init__(self, prompt: Sequence[int], reply: Sequence[int], right_from: int) -> None:
        self.prompt_length, self.reply, self.right_from = len(prompt), list(reply), right_from

    def prepare(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        at = len(history) - self.prompt_length  # reply tokens already in history
        guesses = self.reply[at : at + k]
        if at < self.right_from:
            return [token ^ 1 for token in guesses]  # another token of its (even) vocabulary
        return guesses

    def close(self) -> None:
        pass


def test_a_paused_speculation_resumes_on_would_be_checks_that_hold(tiny_path, tiny_reference):
    """Guesses that miss pause speculation; while paused, the free drafter's would-be checks are
    followed without a decode, and speculation resumes only once they hold. The text is plain
    greedy's."""
    from cli.engine.speculative import EMPTY_CHECKS, Speculator

    with Engine(tiny_path, LoadOptions(n_ctx=1024, threads=1)) as engine:
        prompt = engine.tokenize("a b c d e f g h " * 4)
        plain = [e.token for e in engine.stream_generate(prompt, 200, GREEDY)]
        assert len(plain) == 200
        right_from = 100
        drafter = ScriptedDrafter(prompt, plain, right_from)
        engine.speculator = Speculator(SpecOptions("ngram"), drafter)
        events = list(engine.stream_generate(prompt, 200, GREEDY))
        stats = engine.speculator.last_stats
        engine.speculator = None
    assert_near_tokens(tiny_reference, prompt, plain, [e.token for e in events])
    assert stats.pauses >= 1 and stats.first_paused_at is not None
    assert stats.first_paused_at < right_from  # the wrong guesses paused it early
    assert stats.watched > 0
    # The checks that held nothing are the few that paused it: none was paid for while paused.
    assert stats.bursts.count(1) == EMPTY_CHECKS
    # It resumed only on the right guesses: every guess it accepted lies past right_from, and
    # it accepted many (the copied part).
    assert stats.guessed and min(stats.guessed) > right_from
    assert stats.accepted >= 50

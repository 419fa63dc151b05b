"""Reasoning kept apart from the answer, driven end to end with real sampling: a grammar makes the
tiny model write a think block and an answer, a template that opens the block in the prompt plus
--think-budget closes it; run's stdout, stderr and --json, chat's folded line."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.reasoning import ReasoningSplitter
from cli.engine.sampling import SamplingParams

from tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
THINK_THEN_ANSWER = r'root ::= "<think>" [a-z ]{3,12} "</think>" "\n\n" [a-z]{2,8}'


def expected_split(text: str, opened: bool) -> tuple[str, str]:
    """The split by a regular expression over the whole text: the reference."""
    if opened:
        text = "<think>" + text
    match = re.match(r"\s*(<think>|\[THINK\])(.*?)(</think>|\[/THINK\])\s*(.*)", text, re.S)
    if match:
        return match.group(2), match.group(4)
    match = re.match(r"\s*(<think>|\[THINK\])(.*)", text, re.S)
    if match:
        return match.group(2), ""
    return "", text


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        ("<think>a < b, so</think>\n\nThe answer.", False),
        ("  <think>\nhmm </thi nk> </think>ok", False),
        ("[THINK]short[/THINK] done", False),
        ("no reasoning <think>here</think>", False),
        ("<thin", False),
        ("<think>never closed", False),
        ("inside already</think>\n\nanswer", True),
        ("still thinking </thi", True),
    ],
)
def test_splitter_gives_the_same_split_however_the_text_is_cut(text: str, opened: bool) -> None:
    rng = random.Random(7)
    cuts_list = [list(range(1, len(text)))] + [
        sorted(rng.sample(range(1, len(text)), k=min(3, len(text) - 1))) for _ in range(20)
    ]
    for cuts in cuts_list:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        splitter = ReasoningSplitter(("<think>", "</think>") if opened else None)
        reasoning, answer = "", ""
        for piece in pieces:
            r, a = splitter.push(piece)
            reasoning, answer = reasoning + r, answer + a
        r, a = splitter.finish()
        assert (reasoning + r, answer + a) == expected_split(text, opened), cuts


def test_engine_splits_a_grammar_forced_think_block(tiny_path: Path) -> None:
    """The tiny model, forced by a grammar, writes <think>...</think> then an answer: the events
    carry exactly the two halves of the raw text the same seed gives without splitting."""
    sampling = SamplingParams(temperature=1.0, seed=11, grammar=THINK_THEN_ANSWER)
    with Engine(tiny_path, LoadOptions(n_ctx=512, threads=1)) as engine:
        prompt = engine.conversation_text([("user", "Think, then answer.")])[0]
        raw = "".join(e.text for e in engine.stream_text(prompt, 60, sampling))
        events = list(engine.stream_chat([("user", "Think, then answer.")], 60, sampling))
    assert raw.startswith("<think>") and "</think>" in raw
    reasoning = "".join(e.reasoning for e in events)
    answer = "".join(e.text for e in events)
    assert (reasoning, answer) == expected_split(raw, False)
    assert answer and reasoning
    assert events[-1].finish_reason == "stop"
    thinking = [e.thinking for e in events]
    # thinking tokens come first, then answer tokens, never mixed
    assert thinking == sorted(thinking, reverse=True) and any(thinking) and not all(thinking)


@pytest.fixture(scope="module")
def r1_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-R1-Distill's template (as llama.cpp keeps it): with thinking on, the prompt ends
    inside an open <think> block."""
    source = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text("utf-8")
    folder = tmp_path_factory.mktemp("r1")
    return write_tiny_llama(folder / "r1.gguf", n_layer=1, chat_template=source)


def test_run_splits_stdout_stderr_and_json_with_a_think_budget(runner, r1_path: Path) -> None:
    from cli.app import app

    # one thread count: one compute path for the three runs
    args = ["run", "-m", str(r1_path), "hi", "-n", "10", "--seed", "4", "-t", "1", "--think"]
    as_json = runner.invoke(app, [*args, "--think-budget", "3", "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["thinking_tokens"] == 3 and out["answer_tokens"] == 7
    assert out["generation_tokens"] == 10 and out["reasoning"] and out["text"]
    assert out["time_to_first_answer_s"] >= out["ttft_s"]

    plain = runner.invoke(app, [*args, "--think-budget", "3"])
    assert plain.exit_code == 0, plain.stderr
    # same path: one command, printed two ways; the answer alone on stdout
    assert plain.stdout == out["text"] + "\n"
    assert plain.stderr.startswith(out["reasoning"] + "\n")  # the reasoning first on stderr
    assert "thinking 3 tok, answer 7 tok" in plain.stderr

    hidden = runner.invoke(app, [*args, "--think-budget", "3", "--hide-thinking"])
    assert hidden.stdout == plain.stdout  # same path: only what stderr shows differs
    assert out["reasoning"] not in hidden.stderr

    # Without a budget the block never closes: everything is reasoning, stdout stays empty.
    unbounded = runner.invoke(app, [*args, "--json"])
    whole = json.loads(unbounded.stdout)
    assert whole["text"] == "" and whole["thinking_tokens"] == 10 and whole["reasoning"]
    # --no-think: the template closes the block itself, and nothing is reasoning.
    off = json.loads(runner.invoke(app, [*args[:-1], "--no-think", "--json"]).stdout)
    assert off["reasoning"] == "" and off["thinking_tokens"] == 0 and off["text"]


def test_think_switch_on_a_template_without_one_says_so(runner, tiny_path: Path) -> None:
    from cli.app import app

    result = runner.invoke(app, ["run", "-m", str(tiny_path), "hi", "-n", "2", "--no-think"])
    assert result.exit_code == 0
    assert "has no thinking switch" in result.stderr


def test_chat_folds_reasoning_and_think_shows_it(runner, r1_path: Path) -> None:
    from cli.app import app

    args = ["chat", "-m", str(r1_path), "-n", "5", "--seed", "2", "--think"]
    result = runner.invoke(app, args, input="hello\n/think\n")
    assert result.exit_code == 0, result.stderr
    assert "(thought for 5 tokens; /think shows it)" in result.stderr
    # the reply's reasoning is what run gives with the same seed and prompt
    run = runner.invoke(
        app, ["run", "-m", str(r1_path), "hello", "-n", "5", "--seed", "2", "--think", "--json"]
    )
    reasoning = json.loads(run.stdout)["reasoning"]
    assert reasoning and reasoning + "\n" in result.stderr


def test_template_options_with_endpoint_are_refused(runner) -> None:
    from cli.app import app

    result = runner.invoke(
        app, ["run", "--endpoint", "http://127.0.0.1:9/v1", "hi", "--think-budget", "3"]
    )
    assert result.exit_code == 2
    assert "apply to a local model" in result.stderr and len(result.stderr.splitlines()) == 1


# --- a grammar holds the answer, not the reasoning (lazy, as llama.cpp's lazy grammars) -----

POINT = {
    "type": "object",
    "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["x", "ok"],
}


def test_a_schema_holds_the_answer_after_the_reasoning(r1_path: Path) -> None:
    """R1's template opens the block in the prompt: the reasoning is the model's own (the same
    tokens the same seed gives without a grammar), the answer after --think-budget's closing tag
    is held to the schema. Held from the first token, the block would be JSON and never close."""
    from cli.engine import structured

    constraint = structured.schema_constraint(POINT)
    messages = [("user", "A point, please.")]
    with Engine(r1_path, LoadOptions(n_ctx=512, threads=1)) as engine:
        engine.enable_thinking, engine.think_budget = True, 4
        for seed in range(5):
            free_sampling = SamplingParams(temperature=1.0, seed=seed)
            free = list(engine.stream_chat(messages, 60, free_sampling))
            held_sampling = SamplingParams(temperature=1.0, seed=seed, grammar=constraint.grammar)
            held = list(engine.stream_chat(messages, 60, held_sampling))
            reasoning = "".join(e.reasoning for e in held)
            assert reasoning == "".join(e.reasoning for e in free) and reasoning.strip(), seed
            answer = "".join(e.text for e in held)
            assert held[-1].finish_reason == "stop", (seed, answer)
            assert structured.schema_violation(POINT, json.loads(answer)) is None, (seed, answer)


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3's template: with thinking on, the model itself decides whether to open a block."""
    source = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text("utf-8")
    folder = tmp_path_factory.mktemp("qwen3")
    return write_tiny_llama(folder / "qwen3.gguf", n_layer=1, chat_template=source)


def test_a_reply_that_does_not_reason_is_held_from_its_first_word(qwen3_path: Path) -> None:
    """The tiny model does not open a block: the grammar holds it from its first non-blank token,
    so the whole answer is the schema's JSON, seed after seed."""
    from cli.engine import structured

    constraint = structured.schema_constraint(POINT)
    with Engine(qwen3_path, LoadOptions(n_ctx=512, threads=1)) as engine:
        assert engine.reasoning_may_open
        for seed in range(8):
            sampling = SamplingParams(temperature=1.0, seed=seed, grammar=constraint.grammar)
            events = list(engine.stream_chat([("user", "A point.")], 60, sampling))
            answer = "".join(e.text for e in events)
            assert "".join(e.reasoning for e in events) == "", (seed, answer)
            assert structured.schema_violation(POINT, json.loads(answer)) is None, (seed, answer)


def test_run_schema_with_a_reasoning_model(runner, r1_path: Path) -> None:
    """Through run: the reasoning on stderr is free text, stdout holds the schema's JSON."""
    from cli.app import app

    args = ["run", "-m", str(r1_path), "hi", "-n", "60", "--seed", "3", "--think"]
    result = runner.invoke(app, [*args, "--think-budget", "4", "--schema", "x int, ok bool"])
    assert result.exit_code == 0, result.stderr
    answer = json.loads(result.stdout)
    assert set(answer) == {"x", "ok"} and isinstance(answer["x"], int)
    reasoning = result.stderr.splitlines()[0]
    assert reasoning.strip() and not reasoning.lstrip().startswith("{")


@pytest.mark.parametrize(
    ("tail", "pieces", "free"),
    [
        ("<|im_start|>assistant\n", ["\n", "<think>", "a b", "</think>", "\n\n", "{", "1"],
         [True, True, True, True, True, False, False]),
        ("assistant\n<think>\n", ["a", "</th", "ink>", "{"], [True, True, True, False]),
        ("assistant\n", ["{", "<think>"], [False, False]),
        ("<think>\n\n</think>\n\n", ["\n", "<think>"], [True, False]),  # a closed block
        ("user: hi\n", ["<th", "ink>x</think>", "[1]"], [True, True, False]),
        ("x", ["[THINK]", "hm", "[/THINK]", "ok"], [True, True, True, False]),
    ],
)  # fmt: skip
def test_reasoning_wait_lets_through_exactly_the_block(tail, pieces, free) -> None:
    from cli.engine.reasoning import ReasoningWait

    wait = ReasoningWait(tail)
    assert [wait.free(piece) for piece in pieces] == free
    assert wait.holding

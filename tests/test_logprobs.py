"""Logprobs (issue 29): each generated token's log-probability and the most likely tokens at its
step, from the engine, from quill serve (chat and legacy completions, whole and streamed, checked
with the official openai client) and in quill run --json. On the real SmolLM2; every check is a
property of the numbers (greedy picks the most likely token, probabilities sum to one, the entries
spell the reply), never a stored output."""

from __future__ import annotations

import json
import math
import subprocess

import httpx2 as httpx
import numpy as np
import openai
import pytest

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.events import MAX_TOP_LOGPROBS
from cli.engine.logprobs import log_softmax
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.tokenstep import SequenceStep

from conftest import KEY, QUILL, quill_env, start_server

GREEDY = SamplingParams(temperature=0)
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def engine(smollm2_path):
    loaded = Engine(smollm2_path, LoadOptions(n_ctx=512))
    yield loaded
    loaded.close()


def generate(engine: Engine, top: int | None, max_tokens: int = 12, stop=(), sampling=GREEDY):
    engine.logprobs = top
    engine.clear_cache()
    try:
        prompt = engine.tokenize(engine.conversation_text(QUESTION)[0])
        return list(engine.stream_generate(prompt, max_tokens, sampling, stop))
    finally:
        engine.logprobs = None


def entries_of(events):
    return [entry for event in events for entry in event.logprobs]


def scored_tokens(usage_tokens: int, finish_reason: str | None) -> int:
    """Tokens that have an entry: all but an end-of-generation token that ended the reply."""
    return usage_tokens - (finish_reason == "stop")


def check_entry(chosen: float, top: list[float], size: int) -> None:
    assert chosen <= 0 and all(value <= 0 for value in top)
    assert len(top) == size
    assert top == sorted(top, reverse=True)
    assert sum(math.exp(value) for value in top) <= 1 + 1e-9


# --- the engine -------------------------------------------------------------------------------


def test_greedy_tokens_carry_the_largest_logprob_of_their_step(engine):
    events = generate(engine, 5)
    entries = entries_of(events)
    assert len(entries) == events[-1].generation_tokens  # a "length" finish: every token
    for entry in entries:
        top = [candidate.logprob for candidate in entry.top]
        check_entry(entry.chosen.logprob, top, 5)
        assert entry.chosen.logprob == max(top) == top[0]
        assert entry.chosen.piece == engine.piece(entry.chosen.token)
    # The entries spell the reply, byte for byte.
    text = "".join(event.text for event in events)
    assert b"".join(entry.chosen.piece for entry in entries).decode() == text


def test_sampled_tokens_are_scored_on_the_raw_distribution(engine):
    """At temperature 1.5 the chain picks tokens that are not the most likely; each is still
    scored by the model's own distribution, so its logprob is one of its step's, at most the
    best, and is in the top list when the list is long enough to hold it."""
    sampling = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    entries = entries_of(generate(engine, MAX_TOP_LOGPROBS, 16, sampling=sampling))
    assert entries
    for entry in entries:
        top = [candidate.logprob for candidate in entry.top]
        check_entry(entry.chosen.logprob, top, MAX_TOP_LOGPROBS)
        assert entry.chosen.logprob <= top[0]
        if entry.chosen.logprob > top[-1]:
            assert entry.chosen.token in [candidate.token for candidate in entry.top]


def test_logprobs_of_real_logits_are_a_distribution_and_the_top_is_its_best(engine):
    engine.clear_cache()
    prompt = engine.tokenize(engine.conversation_text(QUESTION)[0])
    rows = engine.window_logits(prompt, len(prompt) - 4)
    for row in rows:
        full = log_softmax(row)
        assert abs(np.exp(full).sum() - 1) < 1e-9
        assert full.max() <= 0
        token = int(np.argmin(row))  # any token: the least likely
        entry = engine.token_logprobs(row, token, MAX_TOP_LOGPROBS)
        assert entry.chosen.logprob == full[token] == full.min()
        best = np.sort(full)[::-1][:MAX_TOP_LOGPROBS]
        assert [candidate.logprob for candidate in entry.top] == list(best)
        assert all(full[candidate.token] == candidate.logprob for candidate in entry.top)


def test_nothing_is_computed_when_not_asked(engine, monkeypatch):
    def refuse(*_args):
        raise AssertionError("logprobs computed though nobody asked")

    monkeypatch.setattr(engine, "token_logprobs", refuse)
    events = generate(engine, None, 4)
    assert all(event.logprobs is None for event in events)


def test_zero_alternatives_still_score_each_token(engine):
    entries = entries_of(generate(engine, 0, 4))
    assert len(entries) == 4 and all(entry.top == () for entry in entries)
    assert all(entry.chosen.logprob <= 0 for entry in entries)


def test_a_stop_strings_tokens_and_the_end_token_have_no_entry(engine):
    free = generate(engine, 1, 24)
    text = "".join(event.text for event in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = generate(engine, 1, 24, stop=[stop])
    assert stopped[-1].stop_string == stop
    cut = "".join(event.text for event in stopped)
    entries = entries_of(stopped)
    spelled = b"".join(entry.chosen.piece for entry in entries).decode("utf-8", "replace")
    # The entries end with the token that released the last text: past the cut, only the
    # start of the stop string that token carried.
    assert spelled.startswith(cut) and stop.startswith(spelled[len(cut) :])
    # Each entry released some text before the stop string: none is all stop string.
    starts = np.cumsum([0] + [len(e.chosen.piece.decode("utf-8", "replace")) for e in entries])
    assert all(start < len(cut) for start in starts[:-1])
    # A reply that ends by itself: the end-of-generation token is no text and has no entry.
    ended = generate(engine, 1, 200)
    if ended[-1].finish_reason == "stop" and ended[-1].stop_string is None:
        assert len(entries_of(ended)) == ended[-1].generation_tokens - 1


def test_a_step_refuses_more_than_twenty_alternatives(engine):
    with pytest.raises(ValueError, match="logprobs must be 0 to 20"):
        SequenceStep(engine, [1, 2], 4, GREEDY, (), 0, 0.0, logprobs=MAX_TOP_LOGPROBS + 1)


# --- quill serve --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_path, quill_home, tmp_path_factory):
    process, url = start_server(
        quill_home, tmp_path_factory.mktemp("serve-logprobs"),
        "-m", str(smollm2_path), "--parallel", "2", "--ctx", "512", "--api-key", KEY,
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def chat(client, **extra):
    return client.chat.completions.create(
        model="quill", messages=QUESTION, max_tokens=8, temperature=0, **extra
    )


def test_chat_logprobs_whole_and_streamed(client):
    reply = chat(client, logprobs=True, top_logprobs=3)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == scored_tokens(reply.usage.completion_tokens, choice.finish_reason)
    for item in content:
        top = [alternative.logprob for alternative in item.top_logprobs]
        check_entry(item.logprob, top, 3)
        assert item.logprob == max(top)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
    # same path: one reply's entries spell that reply
    assert b"".join(bytes(item.bytes) for item in content).decode() == choice.message.content

    streamed, streamed_text = [], ""
    # No prefix cache: the streamed request prefills as the whole one did (one compute path).
    extra = {"extra_body": {"cache_prompt": False}}
    chunks = chat(client, logprobs=True, top_logprobs=3, stream=True, **extra)
    for chunk in chunks:
        for part in chunk.choices:
            streamed_text += part.delta.content or ""
            if part.logprobs is not None and part.logprobs.content:
                streamed += part.logprobs.content
    # same path: the streamed reply's own entries spell it
    assert b"".join(bytes(item.bytes) for item in streamed).decode() == streamed_text
    # same path: the keys of the entries, not texts
    assert {tuple(sorted(item.model_dump())) for item in streamed} == {
        tuple(sorted(item.model_dump())) for item in content
    }
    for item in streamed:
        assert item.logprob == max(alternative.logprob for alternative in item.top_logprobs)


def test_chat_without_logprobs_has_none(client):
    assert chat(client).choices[0].logprobs is None


def test_llama_server_n_probs_asks_for_the_same(client):
    reply = chat(client, extra_body={"n_probs": 2})
    assert all(len(item.top_logprobs) == 2 for item in reply.choices[0].logprobs.content)
    completion = client.completions.create(
        model="quill", prompt="Hello", max_tokens=3, temperature=0, extra_body={"n_probs": 1}
    )
    legacy = completion.choices[0].logprobs
    assert legacy.tokens and all(1 <= len(top) <= 2 for top in legacy.top_logprobs)
    assert chat(client, extra_body={"n_probs": 0}).choices[0].logprobs is None


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"logprobs": True, "top_logprobs": 21}, "between 0 and 20"),
        ({"top_logprobs": 2}, "needs 'logprobs': true"),
        ({"logprobs": False, "top_logprobs": 2}, "needs 'logprobs': true"),
        ({"logprobs": True, "top_logprobs": -1}, "between 0 and 20"),
        ({"logprobs": True, "top_logprobs": 1.5}, "whole number"),
        ({"logprobs": True, "top_logprobs": "3"}, "must be a number"),
        ({"logprobs": 3}, "true or false"),
        ({"n_probs": 21}, "between 0 and 20"),
        ({"logprobs": True, "top_logprobs": 2, "n_probs": 4}, "disagree"),
    ],
)
def test_bad_chat_logprobs_are_400(server, client, extra, needle):
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": QUESTION, "max_tokens": 2, **extra},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and needle in error["message"]
    assert chat(client).choices[0].message.content  # the server goes on


def test_completions_legacy_logprobs_whole_and_streamed(client):
    prompt = "The colours of the rainbow are"
    reply = client.completions.create(
        model="quill", prompt=prompt, max_tokens=8, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    logprobs = choice.logprobs
    n = len(logprobs.tokens)
    assert n == scored_tokens(reply.usage.completion_tokens, choice.finish_reason)
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset)
    assert "".join(logprobs.tokens) == choice.text  # same path: one reply's entries
    for token, value, top, offset in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, logprobs.text_offset,
        strict=True,
    ):  # fmt: skip
        assert value <= 0 and top[token] == value == max(top.values())
        assert 1 <= len(top) <= 3  # the two likeliest and the chosen one, as OpenAI's legacy API
        assert choice.text[offset:].startswith(token)

    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    keys = set()
    for chunk in client.completions.create(
        model="quill", prompt=prompt, max_tokens=8, temperature=0, logprobs=2, stream=True
    ):
        part = chunk.choices[0].logprobs
        if part is not None:
            keys.add(tuple(sorted(part.model_dump())))
            for key in streamed:
                streamed[key] += getattr(part, key)
    assert keys == {tuple(sorted(logprobs.model_dump()))}
    assert len(streamed["tokens"]) == n
    text = "".join(streamed["tokens"])
    for token, offset in zip(streamed["tokens"], streamed["text_offset"], strict=True):
        assert text[offset:].startswith(token)  # offsets count on across chunks


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"logprobs": 21}, "between 0 and 20"),
        ({"logprobs": -1}, "between 0 and 20"),
        ({"logprobs": True}, "not true or false"),
        ({"logprobs": "2"}, "must be a number"),
        ({"top_logprobs": 2}, "field of /v1/chat/completions"),
        ({"n_probs": -3}, "between 0 and 20"),
    ],
)
def test_bad_completions_logprobs_are_400(server, extra, needle):
    response = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "Hello", "max_tokens": 2, **extra},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_the_openai_client_sees_the_refusal(client):
    with pytest.raises(openai.BadRequestError, match="between 0 and 20"):
        chat(client, logprobs=True, top_logprobs=21)


# --- quill run ----------------------------------------------------------------------------------


def run_logprobs(runner, *args):
    result = runner.invoke(app, ["run", "--json", "--temperature", "0", "-n", "6", *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_run_json_carries_the_chat_shape(runner, smollm2_path):
    document = run_logprobs(runner, "-m", str(smollm2_path), "--logprobs", "4", "Say hello")
    entries = document["logprobs"]
    assert len(entries) == scored_tokens(document["generation_tokens"], document["finish_reason"])
    for item in entries:
        assert sorted(item) == ["bytes", "logprob", "token", "top_logprobs"]
        top = [alternative["logprob"] for alternative in item["top_logprobs"]]
        check_entry(item["logprob"], top, 4)
        assert item["logprob"] == max(top)
    assert b"".join(bytes(item["bytes"]) for item in entries).decode() == document["text"]
    assert "logprobs" not in run_logprobs(runner, "-m", str(smollm2_path), "Say hello")


def test_run_endpoint_brings_the_servers_logprobs(runner, server):
    document = run_logprobs(
        runner, "--endpoint", f"{server}/v1", "--api-key", KEY, "--logprobs", "2", "Say hello"
    )
    entries = document["logprobs"]
    assert len(entries) == scored_tokens(document["generation_tokens"], document["finish_reason"])
    assert all(
        item["logprob"] == max(a["logprob"] for a in item["top_logprobs"]) for item in entries
    )


def test_run_logprobs_without_json_prints_only_the_reply(runner, smollm2_path):
    result = runner.invoke(
        app, ["run", "-m", str(smollm2_path), "--temperature", "0", "-n", "4", "--no-stats",
              "--logprobs", "3", "Say hello"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert "logprob" not in result.stdout
    assert "--logprobs shows only in --json output" in result.stderr


@pytest.mark.parametrize(
    "value, needle", [("21", "0<=x<=20"), ("-1", "0<=x<=20"), ("two", "not a valid int")]
)
def test_run_refuses_bad_logprobs(quill_home, smollm2_path, value, needle):
    result = subprocess.run(
        [QUILL, "run", "-m", str(smollm2_path), "--json", "--logprobs", value, "hi"],
        capture_output=True, text=True, env=quill_env(quill_home), timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quill: error: "), result.stderr
    assert "--logprobs" in lines[0] and needle in lines[0]
    assert result.stdout == ""


def test_run_refuses_logprobs_with_speculation(runner, smollm2_path):
    result = runner.invoke(
        app, ["run", "-m", str(smollm2_path), "--logprobs", "2", "--spec", "ngram", "hi"]
    )
    assert result.exit_code == 2
    assert "--logprobs cannot go with --spec ngram" in result.stderr

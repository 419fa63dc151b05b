"""llama-server's native POST /completion on quill serve (cli/api/native.py), over raw HTTP on a
tiny model the tests write: a prompt as text, as token ids and as both mixed; n_predict,
ignore_eos, stop words, n_probs, return_tokens, response_fields; the stream's frames; the
timings; the prompt cache; and hostile bodies, each a 400 naming its field, the server answering
on."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from conftest import raw_exchange, start_server
from tinymodel import write_tiny_llama

CTX = 512
BATCH = 16  # --batch-size: a prompt of a few dozen tokens prefills over several steps
PROMPT = "the old merchant watches the quiet harbour"
GREEDY = {"temperature": 0, "ignore_eos": True}  # a reply of exactly n_predict tokens


@pytest.fixture(scope="module")
def server(quill_home, tmp_path_factory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("serve-native")
    model = write_tiny_llama(folder / "tiny.gguf", n_layer=1)
    process, url = start_server(
        quill_home, folder, str(model),
        "--ctx", str(CTX), "--parallel", "2", "--body-timeout", "1", "--batch-size", str(BATCH),
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert "Traceback" not in process.stderr.read()


def post(server: str, body: dict | bytes, path: str = "/completion") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server}{path}", content=content, headers=headers, timeout=60)


def complete(server: str, body: dict) -> dict:
    response = post(server, body)
    assert response.status_code == 200, response.text
    return response.json()


def token_ids(server: str, text: str, add_special: bool = True) -> list[int]:
    reply = post(server, {"content": text, "add_special": add_special}, "/tokenize")
    assert reply.status_code == 200
    return reply.json()["tokens"]


def stream_text(server: str, body: dict) -> str:
    with httpx.stream(
        "POST", f"{server}/completion", json={**body, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        return response.read().decode()


# --- the prompt -----------------------------------------------------------------------------------


def test_a_prompt_as_text_as_token_ids_and_mixed_evaluates_the_same_tokens(server):
    ids = token_ids(server, PROMPT)
    as_text = complete(server, {"prompt": PROMPT, "n_predict": 1})
    as_ids = complete(server, {"prompt": ids, "n_predict": 1})
    as_object = complete(server, {"prompt": {"prompt_string": PROMPT}, "n_predict": 1})
    assert as_text["tokens_evaluated"] == len(ids) > 1
    assert as_ids["tokens_evaluated"] == as_object["tokens_evaluated"] == len(ids)
    # same path: no model involved, the prompt's tokens spelled out once each way
    assert as_ids["prompt"] == as_text["prompt"]
    # Token ids then text: the text's tokens follow the ids, with no BOS of their own.
    tail = " harbour"
    mixed = complete(server, {"prompt": [*ids, tail], "n_predict": 1})
    assert mixed["tokens_evaluated"] == len(ids) + len(token_ids(server, tail, False))
    assert mixed["prompt"].endswith(PROMPT + tail)


# --- n_predict, stop words, probabilities, tokens -------------------------------------------------


def test_several_prompts_are_answered_as_a_list_in_their_order(server):
    ids = token_ids(server, PROMPT)
    prompts = [ids, "a second prompt", {"prompt_string": "and a third"}]
    body = {"prompt": prompts, "n_predict": 3, "return_tokens": True, **GREEDY}
    replies = complete(server, body)
    assert isinstance(replies, list) and [r["index"] for r in replies] == [0, 1, 2]
    assert [r["tokens_evaluated"] for r in replies] == [
        len(ids),
        len(token_ids(server, "a second prompt")),
        len(token_ids(server, "and a third")),
    ]
    assert all(len(r["tokens"]) == r["tokens_predicted"] == 3 for r in replies)
    assert replies[1]["prompt"].endswith("a second prompt")
    # Streamed: each prompt's frames carry its index, and each ends with its own last frame.
    frames = stream_frames(server, "/completion", body)
    assert sorted(f["index"] for f in frames if f["stop"]) == [0, 1, 2]
    assert sorted(f["index"] for f in frames if f["tokens"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # Refused before the model is taken: nothing stays counted in flight.
    for refused in ({"prompt": ["p"] * 9}, {"prompt": "p", "n": 99}):
        assert (
            post(
                server, refused, "/v1/completions" if "n" in refused else "/completion"
            ).status_code
            == 400
        )
    assert [m["requests"] for m in httpx.get(f"{server}/api/ps").json()["models"]] == [0]
    # A list with one prompt, or with a token id in it, is one prompt: one reply, not a list.
    assert isinstance(complete(server, {**body, "prompt": ["just one"]}), dict)
    assert isinstance(complete(server, {**body, "prompt": [*ids, "more"]}), dict)


def test_n_predict_bounds_the_reply_and_with_ignore_eos_is_met_exactly(server):
    bounded = complete(server, {"prompt": PROMPT, "n_predict": 3, "temperature": 0})
    assert 1 <= bounded["tokens_predicted"] <= 3
    if bounded["stop_type"] == "limit":
        assert bounded["tokens_predicted"] == 3
    exact = complete(server, {"prompt": PROMPT, "n_predict": 5, **GREEDY})
    assert exact["tokens_predicted"] == exact["timings"]["predicted_n"] == 5
    assert exact["stop_type"] == "limit" and exact["stopping_word"] == ""
    settings = exact["generation_settings"]
    assert settings["n_predict"] == 5 and settings["ignore_eos"] is True
    assert settings["temperature"] == 0 and exact["stop"] is True and exact["truncated"] is False


def test_llama_servers_own_values_are_read_its_way(server):
    """n_predict -1: until the context is full; seed -1: a random seed, reported; a negative
    temperature: greedy."""
    body = {"prompt": PROMPT, "n_predict": -1, "seed": -1, "temperature": -1}
    reply = complete(server, body)
    settings = reply["generation_settings"]
    assert settings["n_predict"] == -1 and settings["temperature"] == 0
    assert isinstance(settings["seed"], int) and settings["seed"] >= 0
    if reply["stop_type"] == "limit":  # the context is full
        assert reply["tokens_evaluated"] + reply["tokens_predicted"] == CTX
    seeded = complete(server, {"prompt": PROMPT, "n_predict": 1, "seed": 7})
    assert seeded["generation_settings"]["seed"] == 7


def test_a_stop_word_ends_the_reply_and_is_not_in_its_content(server):
    # Both requests prefill the whole prompt (no cache): one compute path, one greedy text.
    body = {"prompt": PROMPT, "n_predict": 12, "cache_prompt": False, **GREEDY}
    first = complete(server, body)["content"]
    middle = len(first) // 2
    word = first[middle : middle + 2]
    assert word.strip(), f"no word to stop on in {first!r}"
    stopped = complete(server, {**body, "stop": [word]})
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert word not in stopped["content"]
    assert stopped["generation_settings"]["stop"] == [word]


def test_n_probs_gives_each_token_its_sorted_alternatives(server):
    reply = complete(server, {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, **GREEDY})
    probabilities = reply["completion_probabilities"]
    assert len(probabilities) == 4 and reply["generation_settings"]["n_probs"] == 3
    for entry in probabilities:
        assert isinstance(entry["id"], int) and isinstance(entry["token"], str)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert entry["logprob"] <= 0
        top = [candidate["logprob"] for candidate in entry["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert all({"id", "token", "bytes", "logprob"} <= set(c) for c in entry["top_logprobs"])
    assert "completion_probabilities" not in complete(server, {"prompt": PROMPT, "n_predict": 2})


def test_post_sampling_probs_are_of_what_the_sampler_chain_drew_from(server):
    body = {"prompt": PROMPT, "n_predict": 6, "n_probs": 5, "post_sampling_probs": True,
            "ignore_eos": True, "seed": 7}  # fmt: skip
    # top_k 3: at most three tokens can be drawn at each step, whatever their raw logits say
    reply = complete(server, {**body, "temperature": 1.0, "top_k": 3, "min_p": 0, "top_p": 1})
    assert reply["generation_settings"]["post_sampling_probs"] is True
    for entry in reply["completion_probabilities"]:
        top = entry["top_probs"]
        assert "logprob" not in entry and "top_logprobs" not in entry
        assert 1 <= len(top) <= 3 and all(0 < c["prob"] <= 1 for c in top)
        assert sum(c["prob"] for c in top) == pytest.approx(1.0)  # the whole distribution
        assert [c["prob"] for c in top] == sorted((c["prob"] for c in top), reverse=True)
        assert entry["id"] in [c["id"] for c in top]  # the token was drawn from these
        assert entry["prob"] == next(c["prob"] for c in top if c["id"] == entry["id"])
    # The same seed draws the same tokens with and without the probabilities read.
    plain = complete(server, {**body, "temperature": 1.0, "top_k": 3, "min_p": 0, "top_p": 1,
                              "post_sampling_probs": False, "return_tokens": True})  # fmt: skip
    # same path: one server, each request alone, the same seed
    assert [e["id"] for e in reply["completion_probabilities"]] == plain["tokens"]
    # Greedy draws the best token for certain.
    greedy = complete(server, {**body, "temperature": 0})
    for entry in greedy["completion_probabilities"]:
        alone = {key: entry[key] for key in ("id", "token", "bytes", "prob")}
        assert entry["prob"] == 1.0 and entry["top_probs"] == [alone]
    # On the OpenAI routes the same distribution is given as logprobs.
    chat = post(server, {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
                         "logprobs": True, "top_logprobs": 5, "top_k": 2, "temperature": 1.0,
                         "post_sampling_probs": True}, "/v1/chat/completions").json()  # fmt: skip
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert 1 <= len(entry["top_logprobs"]) <= 2


def test_return_tokens_gives_the_generated_ids(server):
    reply = complete(server, {"prompt": PROMPT, "n_predict": 4, "return_tokens": True, **GREEDY})
    assert len(reply["tokens"]) == 4
    assert all(isinstance(token, int) and token >= 0 for token in reply["tokens"])
    assert complete(server, {"prompt": PROMPT, "n_predict": 2})["tokens"] == []


def test_response_fields_pick_the_fields_of_the_reply(server):
    fields = ["content", "generation_settings/n_predict", "no/such"]
    reply = complete(server, {"prompt": PROMPT, "n_predict": 2, "response_fields": fields})
    assert set(reply) == {"content", "generation_settings/n_predict"}
    assert reply["generation_settings/n_predict"] == 2


# --- the stream -----------------------------------------------------------------------------------


def test_the_stream_sends_a_frame_per_token_and_a_last_one_with_the_whole_reply(server):
    body = {"prompt": PROMPT, "n_predict": 6, "n_probs": 1, "timings_per_token": True, **GREEDY}
    text = stream_text(server, body)
    assert "[DONE]" not in text  # llama-server's native stream sends none
    frames = [json.loads(frame.removeprefix("data: ")) for frame in text.strip().split("\n\n")]
    *tokens, last = frames
    assert len(tokens) == 6 and not any(frame["stop"] for frame in tokens)
    assert all(len(frame["tokens"]) == 1 and "timings" in frame for frame in tokens)
    pieces = "".join(frame["content"] for frame in tokens)
    spelled = b"".join(
        bytes(entry["bytes"]) for frame in tokens for entry in frame["completion_probabilities"]
    ).decode("utf-8", "replace")
    # same path: one stream's text and the bytes of its own tokens
    assert pieces == spelled and pieces
    assert last["stop"] is True and last["stop_type"] == "limit"
    assert last["content"] == "" and last["tokens"] == []  # sent already, as llama-server does
    assert last["tokens_predicted"] == last["timings"]["predicted_n"] == 6
    assert last["generation_settings"]["stream"] is True and "prompt" in last


def stream_frames(server: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    datas = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data:")]
    return [json.loads(data) for data in datas if data != "[DONE]"]


LONG_PROMPT = "a long road winter market seven green lanterns by the quiet harbour " * 5


def test_return_progress_tells_the_prefill_batch_by_batch_before_any_text(server):
    body = {"prompt": LONG_PROMPT, "n_predict": 3, "cache_prompt": False, **GREEDY}
    frames = stream_frames(server, "/completion", {**body, "return_progress": True,
                                                   "timings_per_token": True})  # fmt: skip
    progress = [frame for frame in frames if "prompt_progress" in frame]
    total = len(token_ids(server, LONG_PROMPT))
    # One before the first batch, then one after each batch of at most --batch-size tokens.
    assert len(progress) == 1 + math.ceil(total / BATCH)
    told = [frame["prompt_progress"] for frame in progress]
    assert told[0] == {"total": total, "cache": 0, "processed": 0, "time_ms": 0}
    processed = [one["processed"] for one in told]
    assert processed == [*range(0, total, BATCH), total]
    assert all(one["total"] == total and one["cache"] == 0 for one in told)
    times = [one["time_ms"] for one in told]
    assert times == sorted(times) and times[-1] > 0
    assert progress[0]["timings"]["prompt_n"] == progress[0]["timings"]["prompt_ms"] == 0
    assert progress[-1]["timings"]["prompt_n"] == total and progress[-1]["content"] == ""
    first_text = next(i for i, frame in enumerate(frames) if frame.get("tokens"))
    assert first_text > frames.index(progress[-1])  # the prefill is told before the reply
    # A cached prompt starts where its cache ends; unasked, or not streamed, nothing is told.
    complete(server, {**body, "cache_prompt": True})
    cached = [frame["prompt_progress"] for frame in stream_frames(
        server, "/completion", {**body, "cache_prompt": True, "return_progress": True}
    ) if "prompt_progress" in frame]  # fmt: skip
    assert cached[0]["cache"] == cached[0]["processed"] == total - 1  # the last one is decoded
    assert cached[-1]["processed"] == total and len(cached) == 2
    assert not any(
        "prompt_progress" in frame for frame in stream_frames(server, "/completion", body)
    )
    whole = complete(server, {**body, "return_progress": True})
    assert "prompt_progress" not in whole and whole["tokens_predicted"] == 3


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "chat " + LONG_PROMPT}]},
        ),
        ("/v1/completions", {"prompt": "completions " + LONG_PROMPT}),
        ("/v1/responses", {"input": "responses " + LONG_PROMPT}),
    ],
)
def test_return_progress_on_the_openai_routes(server, path, body):
    asked = {**body, "max_tokens": 2, "temperature": 0, "return_progress": True}
    if path == "/v1/responses":
        asked = {**body, "max_output_tokens": 2, "return_progress": True}
    frames = stream_frames(server, path, asked)
    told = [frame["prompt_progress"] for frame in frames if "prompt_progress" in frame]
    assert len(told) >= 3 and told[-1]["processed"] == told[-1]["total"] > BATCH
    progress = [frame for frame in frames if "prompt_progress" in frame]
    if path == "/v1/responses":
        assert all(frame["type"] == "response.in_progress" for frame in progress)
    else:  # a chunk with nothing generated
        choices = [frame["choices"][0] for frame in progress]
        assert all(choice.get("delta", {}).get("content") is None for choice in choices)
        assert all(choice.get("text", "") == "" for choice in choices)


# --- timings and the prompt cache -----------------------------------------------------------------


@pytest.mark.parametrize("n_predict", [1, 8])
def test_timings_are_finite_and_never_negative(server, n_predict):
    reply = complete(server, {"prompt": PROMPT, "n_predict": n_predict, **GREEDY})
    timings = reply["timings"]
    assert set(timings) >= {
        "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
        "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
    }  # fmt: skip
    for key, value in timings.items():
        assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, key
    assert timings["prompt_ms"] > 0 and timings["prompt_per_token_ms"] > 0
    assert timings["prompt_n"] + timings["cache_n"] == reply["tokens_evaluated"]
    if n_predict == 1:  # one token comes from the prefill's logits: no decode step to rate
        assert timings["predicted_per_second"] == timings["predicted_per_token_ms"] == 0
    else:
        steps = timings["predicted_n"] - 1
        assert timings["predicted_per_second"] == pytest.approx(
            1e3 / timings["predicted_ms"] * steps
        )


def test_a_repeated_prompt_is_read_from_the_cache(server):
    prompt = "a long road winter market seven green lanterns " * 4
    complete(server, {"prompt": prompt, "n_predict": 2})
    again = complete(server, {"prompt": prompt, "n_predict": 2})
    assert again["tokens_cached"] > 0 and again["timings"]["cache_n"] > 0
    assert again["timings"]["prompt_n"] < again["tokens_evaluated"]
    uncached = complete(server, {"prompt": prompt, "n_predict": 2, "cache_prompt": False})
    assert uncached["timings"]["cache_n"] == 0 and uncached["tokens_cached"] == 0


# --- hostile bodies -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"n_predict": 2}, "prompt", "'prompt' must be"),
        ({"prompt": 5}, "prompt", "'prompt' must be"),
        ({"prompt": {"text": "hi"}}, "prompt", "prompt_string"),
        ({"prompt": [1, 1 << 30]}, "prompt", "prompt[1]"),
        ({"prompt": [1, -1]}, "prompt", "prompt[1]"),
        ({"prompt": [1, 2.5]}, "prompt", "prompt[1]"),
        ({"prompt": ["p"] * 9}, "prompt", "9 prompts: at most 8"),
        ({"prompt": [["one", "two"], "three"]}, "prompt", "do not nest"),
        ({"prompt": "hi", "n_predict": "8"}, "n_predict", "'n_predict' must be a number"),
        ({"prompt": "hi", "n_predict": 0}, "n_predict", "at least 1"),
        ({"prompt": "hi", "n_probs": -1}, "n_probs", "'n_probs' must be between"),
        ({"prompt": "hi", "stop": 5}, "stop", "'stop' must be"),
        ({"prompt": "hi", "id_slot": 7}, "id_slot", "'id_slot' must be"),
        ({"prompt": "hi", "return_tokens": "yes"}, "return_tokens", "true or false"),
    ],
)
def test_a_hostile_body_is_a_400_naming_its_field(server, body, param, needle):
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]
    assert complete(server, {"prompt": "hi", "n_predict": 1})["stop"] is True


def test_a_prompt_past_the_context_is_a_400_with_the_context_size(server):
    response = post(server, {"prompt": [5] * (CTX + 10), "n_predict": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"holds {CTX} tokens" in error["message"]
    assert complete(server, {"prompt": "hi", "n_predict": 1})["stop"] is True


def test_a_body_shorter_than_its_length_times_out_and_the_server_answers_on(server):
    started = time.monotonic()
    reply = raw_exchange(
        server,
        b'POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"prompt"',
    )
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "body_timeout"
    assert time.monotonic() - started < 3  # --body-timeout 1
    assert complete(server, {"prompt": "hi", "n_predict": 1})["stop"] is True

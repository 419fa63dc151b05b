"""quill serve on 127.0.0.1 with the real SmolLM2: the official openai client, raw SSE, concurrent
requests through continuous batching, disconnects, the API key, malformed requests, and
quill run --endpoint against it."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx  # httpx's current line, which the openai client is built on
import openai
import pytest
from typer.testing import CliRunner

from cli.app import app

from conftest import KEY, QUILL, quill_env, start_server
from neartie import assert_near
from reference import Reference

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path, quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve"),
        "--parallel", "4", "--ctx", "512", "--api-key", KEY, "--max-body", "65536",
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(smollm2_path) -> Iterator[Reference]:
    """The independent decoder: a reply the server streams, sends whole or gives the CLI is this
    machine's greedy reply up to near-ties (the server's prefix cache changes batch shapes)."""
    decoder = Reference(smollm2_path, n_ctx=512, threads=1)
    yield decoder
    decoder.close()


def chat_tokens(reference: Reference, content: str) -> list[int]:
    return reference.tokenize(reference.chat([("user", content)]), add_special=True)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def ask(server: str, content: str, max_tokens: int = 16, **extra) -> dict:
    response = httpx.post(
        f"{server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
              **GREEDY, **extra},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()


def health(server: str) -> dict:
    return httpx.get(f"{server}/health", timeout=10).json()


# A question SmolLM2 answers in a sentence that names the city (greedy).
CAPITAL = "What is the capital of France? Answer in one sentence."


def test_openai_client_non_streaming_and_streaming(client, reference):
    models = client.models.list()
    # A bare `quill serve`: the default model first, then any other on disk (not loaded yet).
    assert models.data[0].id == "smollm2-135m:q4_1"
    whole = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": CAPITAL}],
        max_tokens=20,
        temperature=0,
    )
    text = whole.choices[0].message.content
    assert "Paris" in text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 5
    pieces, finishes = [], []
    for chunk in client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": CAPITAL}],
        max_tokens=20,
        temperature=0,
        stream=True,
    ):
        pieces.append(chunk.choices[0].delta.content or "")
        finishes.append(chunk.choices[0].finish_reason)
    # greedy: this machine's reply, whole and streamed (the second request finds the first's
    # prompt in the prefix cache, so its tail prefills in another batch shape)
    assert_near(reference, chat_tokens(reference, CAPITAL), text, "".join(pieces))
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    completion = client.completions.create(
        model="smollm2-135m", prompt="The capital of France is", max_tokens=5, temperature=0
    )
    assert completion.choices[0].text and completion.usage.completion_tokens == 5


def test_raw_sse_chunks_arrive_spread_over_time(server):
    arrivals, events = [], []
    body = {"messages": [{"role": "user", "content": "Write a poem about the sea."}],
            "max_tokens": 60, "stream": True, "ignore_eos": True, **GREEDY}  # fmt: skip
    started = time.perf_counter()
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
    ) as response:  # fmt: skip
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.perf_counter() - started)
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] in ("stop", "length")
    assert final["usage"]["completion_tokens"] >= 10
    assert set(final["timings"]) >= {"prompt_ms", "predicted_per_second", "ttft_ms"}
    content = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert all(content) and len(content) >= 10
    # One event per token as it is made, not one burst at the end: the first content chunk
    # arrives before the middle of the stream's duration.
    assert arrivals[1] < arrivals[-1] / 2


def test_concurrent_requests_match_the_same_requests_alone(server):
    prompts = [
        "What is the capital of France?",
        "Name a color.",
        "Count to five.",
        "What is 2 + 2?",
        "Say hello in Spanish.",
        "What is the largest planet?",
    ]
    alone = [ask(server, p, 24)["choices"][0]["message"]["content"] for p in prompts]
    together: dict[int, str] = {}

    def worker(index: int) -> None:
        together[index] = ask(server, prompts[index], 24)["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [together[i] for i in range(len(prompts))] == alone
    assert health(server)["max_sequences_in_a_step"] >= 2  # they really shared decode steps


def test_a_client_that_disconnects_frees_its_slot(server):
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "stream": True, "ignore_eos": True, **GREEDY}  # fmt: skip
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", json=body,
        headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert health(server)["slots_processing"] == 1
    deadline = time.monotonic() + 20
    while health(server)["slots_processing"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert health(server)["slots_processing"] == 0


def test_the_api_key_is_enforced(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    missing = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    wrong = httpx.post(
        f"{server}/v1/chat/completions", json=body, timeout=30,
        headers={"Authorization": "Bearer nope"},
    )  # fmt: skip
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/v1/models", timeout=30).status_code == 401
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def body_of(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "x"}], **fields}).encode()


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"messages": []}).encode(), 400, "'messages'"),
        (body_of(temperature="hot"), 400, "'temperature' must be a number"),
        (body_of(max_tokens=0), 400, "'max_tokens' must be between"),
        (body_of(model="gpt-9"), 404, "does not exist"),
        (json.dumps({"messages": [{"role": "user", "content": "word " * 600}]}).encode(),
         400, "context holds 512 tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}).encode(),
         413, "at most 65536"),
    ],
)  # fmt: skip
def test_malformed_requests_get_openai_errors(server, body, status, needle):
    response = httpx.post(
        f"{server}/v1/chat/completions", content=body, timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )  # fmt: skip
    assert response.status_code == status
    error = response.json()["error"]
    assert needle in error["message"] and error["type"]


def test_a_full_queue_answers_429(smollm2_path, quill_home, tmp_path):
    process, url = start_server(quill_home, tmp_path, "--parallel", "1", "--max-queue", "1")
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300,
            "ignore_eos": True}  # fmt: skip
    try:
        codes: list[int] = []

        def post() -> None:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            codes.append(response.status_code)

        first = threading.Thread(target=post)
        first.start()
        while not health(url)["slots_processing"]:
            time.sleep(0.05)
        second = threading.Thread(target=post)
        second.start()
        while not health(url)["requests_waiting"]:
            time.sleep(0.05)
        third = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        first.join(timeout=120)
        second.join(timeout=120)
        assert codes == [200, 200]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_run_endpoint_reports_the_servers_reply_and_metrics(server, reference):
    expected = ask(server, "What is the capital of France?", 20)["choices"][0]["message"]
    result = CliRunner().invoke(
        app,
        ["run", "--endpoint", f"{server}/v1", "--api-key", KEY, "--temperature", "0", "-n", "20",
         "--json", "What is the capital of France?"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    reply = json.loads(result.stdout)
    question = chat_tokens(reference, "What is the capital of France?")
    assert_near(reference, question, reply["text"], expected["content"])
    assert reply["model"] == "smollm2-135m:q4_1" and reply["path"] == f"{server}/v1"
    assert reply["ttft_s"] > 0 and reply["generation_tokens"] > 0 and reply["prompt_tokens"] > 5
    assert reply["finish_reason"] in ("stop", "length")
    refused = CliRunner().invoke(app, ["run", "--endpoint", f"{server}/v1", "hi"])
    assert refused.exit_code == 6 and "pass --api-key" in refused.stderr


def test_chat_endpoint_keeps_a_conversation_with_the_server(server, quill_home, tmp_path):
    transcript = tmp_path / "remote.json"
    result = subprocess.run(
        [QUILL, "chat", "--endpoint", f"{server}/v1", "--api-key", KEY, "--temperature", "0",
         "-n", "20", "--transcript", str(transcript)],
        input="What is the capital of France? Answer in one sentence.\nAnd of Italy?\n",
        capture_output=True, text=True, env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    messages = json.loads(transcript.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert "Paris" in messages[1]["content"] and messages[3]["content"]
    assert result.stdout.startswith(messages[1]["content"])
    # The second turn sent the whole history; the server's prefix cache held the first turn's,
    # so only the rest was prefilled: the server's usage says how much it reused.
    counts = re.findall(r"prefill (\d+) new tokens \((\d+) cached\)", result.stderr)
    (new_1, cached_1), (new_2, cached_2) = [(int(n), int(c)) for n, c in counts]
    assert cached_2 >= new_1 + cached_1  # the whole first prompt (earlier tests may share some)
    assert new_2 + cached_2 > new_1 + cached_1 + len(messages[1]["content"].split())


def test_bench_endpoint_measures_the_server(server):
    result = CliRunner().invoke(
        app,
        ["bench", "--endpoint", f"{server}/v1", "--api-key", KEY, "-p", "64", "-n", "16",
         "-r", "1", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    rows = {row["test"]: row for row in json.loads(result.stdout)["rows"]}
    assert set(rows) == {"pp64", "tg16"}
    assert rows["pp64"]["tokens_per_s"] > 0 and rows["pp64"]["ttft_ms"] > 0
    assert rows["tg16"]["tokens_per_s"] > 0
    refused = CliRunner().invoke(app, ["bench", "--endpoint", f"{server}/v1", "-d", "512"])
    assert refused.exit_code == 2 and "server's to choose" in refused.stderr

"""One quill serve, many models (issue 31): the real SmolLM2 Q4_1 and a Q8_0 file quantized from
it, loaded on demand by the request's model field, kept for --keep-alive or a request's
keep_alive, evicted least recently used under --max-models (never while streaming), refused
before loading past --memory-limit, and shown and unloaded by quill ps and quill stop."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import psutil
import pytest
from typer.testing import CliRunner

from cli.api.pool import FOREVER, ModelPool, parse_duration
from cli.app import app
from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

from conftest import start_server

KEY = "models-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SMOL = "smollm2-135m:q4_1"
CAPITAL = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def q8_path(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 requantized to Q8_0: a second model, with its own weights and size."""
    from quant.quantize import quantize

    output = tmp_path_factory.mktemp("q8") / "smollm2-q8.gguf"
    quantize(smollm2_path, output, "q8_0", threads=2, allow_requantize=True)
    return output


@pytest.fixture
def serve(quill_home, tmp_path) -> Iterator:
    """Starts `quill serve ARGS --api-key KEY`; every server is stopped at the test's end."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> tuple[subprocess.Popen, str]:
        process, url = start_server(quill_home, tmp_path, *args, "--api-key", KEY)
        started.append(process)
        return process, url

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=30)


def chat(url: str, model: str, max_tokens: int = 16, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": CAPITAL}],
            "max_tokens": max_tokens, "temperature": 0, **extra}  # fmt: skip
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)


def loaded(url: str) -> dict[str, dict]:
    models = httpx.get(f"{url}/api/ps", headers=AUTH, timeout=10).json()["models"]
    return {model["name"]: model for model in models}


def wait_until(check, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def stderr_of(process: subprocess.Popen) -> str:
    process.terminate()
    process.wait(timeout=30)
    return process.stderr.read()


def test_keep_alive_durations_read_as_ollama_writes_them():
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90 and parse_duration(2.5) == 2.5 and parse_duration("0") == 0
    assert parse_duration(-1) == FOREVER and parse_duration("-1m") == FOREVER
    for bad in ("soon", "", "5 minutes", True, None, float("nan")):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_quill_ps_without_a_server_says_so_in_one_line():
    result = CliRunner().invoke(app, ["ps", "--endpoint", "http://127.0.0.1:9"])
    assert result.exit_code == 6 and "is the server running?" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_two_models_answer_alternating_requests_through_the_openai_client(serve, q8_path):
    _, url = serve(SMOL, str(q8_path), "--ctx", "512", "--parallel", "2")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    listed = {m.id: m.model_extra["status"]["value"] for m in client.models.list().data}
    assert listed == {SMOL: "loaded", str(q8_path): "unloaded"}
    for model in ("smollm2-135m", "smollm2-q8", SMOL, str(q8_path)):  # labels and short names
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": CAPITAL}],
            max_tokens=20,
            temperature=0,
        )
        assert reply.model == (SMOL if "135m" in model else str(q8_path))
        assert "Paris" in reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
    listed = {m.id: m.model_extra["status"]["value"] for m in client.models.list().data}
    assert listed == {SMOL: "loaded", str(q8_path): "loaded"}
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["models_loaded"] == 2 and health["slots_idle"] == 4
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert refused.value.body["code"] == "model_not_found"
    bad = chat(url, SMOL, keep_alive="soon")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


def test_keep_alive_expiry_unloads_and_returns_the_memory(serve, q8_path):
    process, url = serve(SMOL, str(q8_path), "--ctx", "512", "--keep-alive", "6s")
    server = psutil.Process(process.pid)
    before = server.memory_info().rss
    assert chat(url, "smollm2-q8").status_code == 200
    with_q8 = server.memory_info().rss
    assert with_q8 - before > 0.6 * q8_path.stat().st_size
    shown = CliRunner().invoke(app, ["ps", "--endpoint", url, "--api-key", KEY])
    assert shown.exit_code == 0 and str(q8_path) in shown.stdout and SMOL in shown.stdout
    q8_row = next(line for line in shown.stdout.splitlines() if str(q8_path) in line)
    assert q8_row.split()[-1] == "s" and 0 < float(q8_row.split()[-2]) <= 6  # "5 s" to unload
    assert SMOL in loaded(url) and loaded(url)[SMOL]["expires_in_s"] is None  # named: kept
    assert wait_until(lambda: str(q8_path) not in loaded(url))
    after = server.memory_info().rss
    assert with_q8 - after > 0.6 * q8_path.stat().st_size
    shown = CliRunner().invoke(app, ["ps", "--endpoint", url, "--api-key", KEY, "--json"])
    assert [m["name"] for m in json.loads(shown.stdout)["models"]] == [SMOL]
    assert f"unloaded {q8_path} (keep-alive passed)" in stderr_of(process)


def test_keep_alive_0_unloads_after_the_reply(serve, q8_path):
    _, url = serve(SMOL, str(q8_path), "--ctx", "512", "--keep-alive", "-1")
    answer = chat(url, "smollm2-q8", keep_alive=0)
    assert (
        answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["message"]["content"]
    )
    assert wait_until(lambda: str(q8_path) not in loaded(url), 10)
    assert chat(url, "smollm2-q8", keep_alive="1h").status_code == 200  # loads again
    assert 3590 < loaded(url)[str(q8_path)]["expires_in_s"] <= 3600
    time.sleep(1.5)
    assert str(q8_path) in loaded(url)  # -1 for the server, 1h for this request


def stream(url: str, model: str, events: list[str], started: threading.Event) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 160, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    events.append(f"ended at {time.monotonic()}")


def test_max_models_1_evicts_the_idle_model_and_never_one_streaming(serve, q8_path):
    process, url = serve(SMOL, str(q8_path), "--ctx", "512", "--max-models", "1")
    events: list[str] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream, args=(url, SMOL, events, started))
    streamer.start()
    assert started.wait(60)
    answer = chat(url, "smollm2-q8")  # waits for the stream: SmolLM2 Q4_1 may not go before
    answered_at = time.monotonic()
    streamer.join(timeout=120)
    assert (
        answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["message"]["content"]
    )
    assert events[-2] == "[DONE]" and json.loads(events[-3])["usage"]["completion_tokens"] == 160
    assert float(events[-1].split()[-1]) <= answered_at
    assert list(loaded(url)) == [str(q8_path)]  # the idle SmolLM2 was evicted for it
    assert chat(url, SMOL).status_code == 200
    assert list(loaded(url)) == [SMOL]
    log = stderr_of(process)
    assert f"unloaded {SMOL} (to make room)" in log and f"unloaded {q8_path} (to make room)" in log


def test_concurrent_first_requests_load_a_model_once(serve, smollm2_path):
    process, url = serve("--any-model", "--ctx", "256", "--parallel", "4", "--keep-alive", "10m")
    assert loaded(url) == {}
    listed = httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert {"id": SMOL, "status": {"value": "unloaded"}}.items() <= {
        key: value for m in listed if m["id"] == SMOL for key, value in m.items()
    }.items()
    answers: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: answers.append(chat(url, "smollm2-135m"))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [a.status_code for a in answers] == [200] * 4
    assert all("Paris" in a.json()["choices"][0]["message"]["content"] for a in answers)
    assert 590 < loaded(url)[SMOL]["expires_in_s"] <= 600
    assert stderr_of(process).count(f"loaded {SMOL} in") == 1


def test_a_bare_quill_serve_loads_the_default_and_serves_every_model_on_disk(serve, smollm2_path):
    _, bare_url = serve("--ctx", "256")
    _, everything_url = serve("--any-model", "--ctx", "256")
    listed = httpx.get(f"{bare_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert listed[0]["id"] == SMOL and listed[0]["status"] == {"value": "loaded"}
    assert list(loaded(bare_url)) == [SMOL] and loaded(everything_url) == {}
    on_disk = httpx.get(f"{everything_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert sorted(m["id"] for m in listed) == sorted(m["id"] for m in on_disk)
    body = {"messages": [{"role": "user", "content": CAPITAL}], "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    reply = httpx.post(f"{bare_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200 and reply.json()["model"].startswith("smollm2-135m")


def test_a_model_past_the_memory_limit_is_refused_before_loading(serve, smollm2_path):
    process, url = serve("--any-model", "--ctx", "256", "--memory-limit", "40MiB")
    server = psutil.Process(process.pid)
    before = server.memory_info().rss
    refused = chat(url, "smollm2-135m")
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "model_too_large" and error["param"] == "model"
    assert "40.0 MiB" in error["message"] and "weights" in error["message"]
    assert "KV cache" in error["message"] and "--memory-limit" in error["message"]
    assert loaded(url) == {} and server.memory_info().rss - before < 20 << 20
    log = stderr_of(process)
    assert log.count("refused smollm2-135m:q4_1 needs") == 1 and "loaded " not in log


def test_quill_stop_unloads_a_model(serve, q8_path):
    process, url = serve(SMOL, str(q8_path), "--ctx", "512")
    assert chat(url, "smollm2-q8").status_code == 200
    runner = CliRunner()
    stopped = runner.invoke(app, ["stop", "smollm2-q8", "--endpoint", url, "--api-key", KEY])
    assert stopped.exit_code == 0 and f"{q8_path} unloaded" in stopped.stderr
    assert list(loaded(url)) == [SMOL]
    again = runner.invoke(app, ["stop", "smollm2-q8", "--endpoint", f"{url}/v1", "--api-key", KEY])
    assert again.exit_code == 0 and "is not loaded" in again.stderr
    keyless = runner.invoke(app, ["ps", "--endpoint", url], env={"QUILL_API_KEY": ""})
    assert keyless.exit_code == 6 and "401" in keyless.stderr
    unknown = runner.invoke(app, ["stop", "gpt-9", "--endpoint", url, "--api-key", KEY])
    assert unknown.exit_code == 3 and "does not exist" in unknown.stderr
    assert chat(url, "smollm2-q8").status_code == 200  # loads again on demand, from its file
    shown = runner.invoke(app, ["ps", "--endpoint", url, "--api-key", KEY])
    assert shown.stdout.splitlines()[0].split() == [
        "NAME",
        "SIZE",
        "SLOTS",
        "BUSY",
        "REQUESTS",
        "UNTIL",
    ]
    log = stderr_of(process)  # stopped, not evicted: nothing was kept mapped
    assert log.count(f"loaded {q8_path} in ") == 2 and "from its mapped weights" not in log


def test_sigterm_drains_every_model_and_refuses_a_load_still_waiting(serve, q8_path):
    process, url = serve(SMOL, str(q8_path), "--ctx", "512", "--max-models", "1",
                         "--drain-timeout", "4")  # fmt: skip
    events: list[str] = []
    started = threading.Event()
    streamer = threading.Thread(target=stream, args=(url, SMOL, events, started))
    streamer.start()
    assert started.wait(60)
    waiting: list[httpx.Response] = []
    loader = threading.Thread(target=lambda: waiting.append(chat(url, "smollm2-q8")))
    loader.start()
    time.sleep(0.5)  # the q8 request waits for SmolLM2's stream to end before it may load
    process.send_signal(signal.SIGTERM)
    loader.join(timeout=30)
    streamer.join(timeout=30)
    assert waiting[0].status_code == 503
    assert waiting[0].json()["error"]["code"] == "server_shutting_down"
    last = events[-2]
    assert last == "[DONE]" or json.loads(last)["error"]["code"] == "server_shutting_down"
    assert process.wait(timeout=30) == 0
    log = process.stderr.read()
    assert "Traceback" not in log and f"loaded {q8_path}" not in log


class TinyCatalog:
    """The pool's Catalog over one real file (serve.py's ServeCatalog opens the same way)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def models(self) -> dict[str, Path]:
        return {"tiny": self.path}

    def open(self, label: str, path: Path) -> BatchScheduler:
        return BatchScheduler(Engine(path, LoadOptions(n_ctx=128, parallel=1, threads=1)))

    def memory_bytes(self, path: Path) -> tuple[int, str]:
        return path.stat().st_size, "its file"


def test_a_model_whose_scheduler_died_is_loaded_again_by_the_next_request(tiny_path):
    events: list[str] = []
    pool = ModelPool(TinyCatalog(tiny_path), on_event=events.append)
    try:
        first = pool.acquire("tiny")
        dying = first.scheduler
        assert dying is not None

        def broken_step() -> None:
            raise RuntimeError("a bug in a step")

        dying._step = broken_step  # the precondition: a loop that dies of an error
        tokens = dying.engine.tokenize("hi")
        refused = dying.submit(BatchRequest(tokens, 2, SamplingParams(temperature=0)))
        with pytest.raises(RuntimeError):
            list(refused.stream())
        assert not dying.alive and dying.failure is not None
        pool.release(first)
        again = pool.acquire("tiny")
        assert again.scheduler is not None and again.scheduler is not dying
        answer = again.scheduler.submit(BatchRequest(tokens, 2, SamplingParams(temperature=0)))
        assert list(answer.stream())[-1].finish_reason == "length"
        pool.release(again)
        assert [" ".join(line.split()[:2]) for line in events] == [
            "loaded tiny",
            "unloaded tiny",
            "loaded tiny",
        ]
        assert "a bug in a step" in events[1] and "loading it again" in events[1]
    finally:
        pool.close()

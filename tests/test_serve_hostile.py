"""quill serve against hostile input and hostile clients (issue 14, the server half), with the real
SmolLM2 behind a real `quill serve` process on 127.0.0.1: values JSON should not hold, broken
HTTP framing, slow and abandoning clients, too many connections, CORS and the Host header, a
request that fails inside the scheduler, a scheduler that stopped, and SIGTERM with streams in
flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

from conftest import QUILL, quill_env, raw_exchange, start_server

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED_ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(smollm2_path, quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("hostile"),
        "--parallel", "2", "--ctx", "512", "--api-key", KEY, "--max-body", "4096",
        "--header-timeout", "1", "--body-timeout", "1", "--cors", ALLOWED_ORIGIN,
        "--threads", "1",  # steadier beside other work on a shared 2-core machine
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert "Traceback" not in process.stderr.read()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def status_and_json(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


def post(url: str, body: bytes | dict, path: str = "/v1/chat/completions", **kwargs):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})}
    kwargs.setdefault("timeout", 60)
    return httpx.post(f"{url}{path}", content=content, headers=headers, **kwargs)


def health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


# --- item 4: values that used to raise inside the handler -----------------------------------------


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}', "NaN"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_k": Infinity}', "Infinity"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": -Infinity}', "-Infinity"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
         "'max_tokens' must be a finite number"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 1e400}',
         "'top_k' must be a finite number"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 1e400}',
         "'seed' must be a finite number"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
         "messages[0].content[0].text must be a string"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
         "messages[0].content[0].text must be a string"),
        (b'{"messages": [{"role": "user", "content": [null]}]}',
         "messages[0].content[0] must be an object"),
        (b'{"messages": [{"role": "user", "content": "a \\ud800 b"}]}', "lone surrogate \\ud800"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
         "lone surrogate \\udfff"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}',
         "lone surrogate"),
        (json.dumps({**HI, "stop": [f"s{i}" for i in range(17)]}).encode(), "at most 16"),
        (json.dumps({**HI, "stop": ["x" * 1100]}).encode(), "at most 1024"),
    ],
)  # fmt: skip
def test_values_json_should_not_hold_are_400s_with_the_reason(server, raw, needle):
    response = post(server, raw)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"
    assert health(server)["status"] == "ok"


def test_a_lone_surrogate_in_a_raw_prompt_is_a_400(server):
    response = post(server, b'{"prompt": "x\\ud800"}', path="/v1/completions")
    assert response.status_code == 400 and "lone surrogate" in response.json()["error"]["message"]


# --- item 3: one request's failure is its own -----------------------------------------------------


def test_a_request_that_fails_in_the_scheduler_gets_a_500_and_the_rest_go_on(tiny_path):
    """A failure inside sampler construction (a top_k that llama.cpp's ctypes binding refuses to
    convert, as it refused issue 14's penalty arguments) fails that request only."""
    engine = Engine(tiny_path, LoadOptions(n_ctx=128, parallel=2))
    scheduler = BatchScheduler(engine)
    try:
        tokens = engine.tokenize("Hello there")
        bad = scheduler.submit(BatchRequest(tokens, 4, SamplingParams(top_k=1.5)))  # type: ignore[arg-type]
        good = scheduler.submit(BatchRequest(tokens, 4, SamplingParams(temperature=0)))
        with pytest.raises(Exception, match="wrong type"):
            list(bad.stream())
        assert list(good.stream())[-1].finish_reason == "length"
        assert scheduler.alive
        after = scheduler.submit(BatchRequest(tokens, 3, SamplingParams(temperature=0)))
        assert list(after.stream())[-1].generation_tokens == 3
    finally:
        scheduler.close()
        engine.close()


def test_a_penalty_request_never_stops_the_server(server):
    """Issue 14: repeat_penalty crashed sampler construction and killed the scheduler thread, so
    every later request hung. Whether the penalty works (200) or fails (500), the next request
    must be answered."""
    penalised = post(server, {**HI, "repeat_penalty": 1.1, "max_tokens": 4})
    assert penalised.status_code in (200, 500), penalised.text
    assert "error" in penalised.json() or penalised.json()["choices"]
    assert post(server, HI).status_code == 200
    assert health(server)["status"] == "ok"


def test_a_stopped_scheduler_makes_health_say_so_and_requests_503_at_once(tiny_path):
    from cli.api.http import HttpLimits, QuillApp
    from cli.api.server import ServerLimits, ServerState

    engine = Engine(tiny_path, LoadOptions(n_ctx=128, parallel=1))
    scheduler = BatchScheduler(engine)
    state = ServerState(scheduler, "tiny:f16", ServerLimits(max_tokens=64))
    app = QuillApp(state, HttpLimits())

    async def exchange() -> tuple[httpx.Response, httpx.Response, httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            alive = await client.post("/v1/chat/completions", json=HI)
            scheduler.close()
            started = time.perf_counter()
            refused = await client.post("/v1/chat/completions", json=HI)
            elapsed = time.perf_counter() - started
            return alive, refused, await client.get("/health"), elapsed

    try:
        alive, refused, after, elapsed = asyncio.run(exchange())
    finally:
        engine.close()
    assert alive.status_code == 200
    assert refused.status_code == 503 and elapsed < 5
    assert refused.json()["error"]["code"] in ("scheduler_stopped", "server_shutting_down")
    assert after.status_code == 503 and after.json()["status"] == "error"


# --- item 2: --parallel beyond what llama.cpp can batch -------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--ctx", "16", "--parallel", "17"], "use --parallel 16 or less, or raise --ctx"),
        (["--ctx", "2048", "--parallel", "600"], "use --parallel 512 or less"),
        (["--ctx", "512", "--parallel", "300"], "sequences llama.cpp can decode together"),
        (["--batch-size", "4", "--parallel", "6"], "use --parallel 4 or less or a larger --batch"),
    ],
)
def test_parallel_beyond_the_batch_is_refused_before_loading(quill_home, args, needle):
    result = subprocess.run(
        [QUILL, "serve", "--port", "0", *args], env=quill_env(quill_home),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# --- the HTTP layer -------------------------------------------------------------------------------


def test_a_negative_content_length_is_a_json_400_at_once(server):
    started = time.monotonic()
    reply = raw_exchange(
        server,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
    )
    status, body = status_and_json(reply)
    assert status == 400 and body["error"]["code"] == "malformed_http"
    assert time.monotonic() - started < 3


def test_a_body_shorter_than_its_length_times_out_with_408(server):
    started = time.monotonic()
    reply = raw_exchange(
        server,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
        + KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"messages\"",
    )  # fmt: skip
    status, body = status_and_json(reply)
    assert status == 408 and body["error"]["code"] == "body_timeout"
    assert b"connection: close" in reply.lower()
    assert 0.9 < time.monotonic() - started < 5  # --body-timeout 1


def test_slowloris_headers_time_out_while_others_are_served(server):
    sockets = []
    for _ in range(20):
        sock = socket.create_connection(("127.0.0.1", port_of(server)), timeout=10)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sockets.append(sock)
    try:
        assert post(server, HI).status_code == 200  # answered while they dangle
        time.sleep(1.5)  # --header-timeout 1
        for sock in sockets:
            sock.sendall(b"X-Slow: 1\r\n")
        for sock in sockets:
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            status, body = status_and_json(reply)
            assert status == 408 and body["error"]["code"] == "header_timeout"
    except (BrokenPipeError, ConnectionResetError):
        pytest.fail("the server reset a slow connection instead of answering 408")
    finally:
        for sock in sockets:
            sock.close()


def test_a_body_is_never_read_as_a_second_request(server):
    """A 401 leaves the body unread; the server must not take it for a pipelined request."""
    smuggled = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    smuggled += b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(smuggled)
        + smuggled
    )
    reply = raw_exchange(server, request, wait_s=3)
    assert reply.count(b"HTTP/1.1 ") == 1 and reply.startswith(b"HTTP/1.1 401")
    assert b"smollm2" not in reply


def test_chunked_bodies_are_parsed_and_capped(server):
    def chunked(payload: bytes) -> Iterator[bytes]:
        for start in range(0, len(payload), 100):
            yield payload[start : start + 100]

    ok = httpx.post(
        f"{server}/v1/chat/completions", content=chunked(json.dumps(HI).encode()),
        headers={**AUTH, "Content-Type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    big = {**HI, "messages": [{"role": "user", "content": "y" * 5000}]}
    refused = httpx.post(
        f"{server}/v1/chat/completions", content=chunked(json.dumps(big).encode()),
        headers={**AUTH, "Content-Type": "application/json"}, timeout=60,
    )  # fmt: skip
    assert refused.status_code == 413 and "at most 4096" in refused.json()["error"]["message"]


def test_every_error_is_json_and_head_and_options_are_answered(server):
    missing = httpx.get(f"{server}/nowhere", headers=AUTH, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "no route /nowhere"
    wrong_method = httpx.get(f"{server}/v1/chat/completions", headers=AUTH, timeout=10)
    assert wrong_method.status_code == 405 and "POST" in wrong_method.headers["allow"]
    assert "not allowed" in wrong_method.json()["error"]["message"]
    head = httpx.head(f"{server}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""
    options = httpx.options(f"{server}/v1/chat/completions", timeout=10)
    assert options.status_code == 204 and "POST" in options.headers["allow"]


def test_cors_only_for_the_origins_given(server):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    allowed = httpx.options(f"{server}/v1/chat/completions", headers=preflight, timeout=10)
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = {**preflight, "Origin": "http://evil.example"}
    refused = httpx.options(f"{server}/v1/chat/completions", headers=other, timeout=10)
    assert refused.status_code == 400 and "error" in refused.json()
    assert "access-control-allow-origin" not in refused.headers
    simple = post(server, HI, headers={"Origin": ALLOWED_ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    foreign = post(server, HI, headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in foreign.headers


def test_the_host_header_is_checked_on_a_loopback_bind(server):
    rebound = httpx.get(
        f"{server}/v1/models", headers={**AUTH, "Host": "attacker.example:8080"}, timeout=10
    )
    assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "invalid_host"
    for host in (f"localhost:{port_of(server)}", "127.0.0.1", f"[::1]:{port_of(server)}"):
        named = httpx.get(f"{server}/v1/models", headers={**AUTH, "Host": host}, timeout=10)
        assert named.status_code == 200, host


def test_a_non_streaming_client_that_leaves_frees_its_slot(server):
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 480, "ignore_eos": True, "temperature": 0}  # fmt: skip
    steps_before = health(server)["decode_steps"]
    with pytest.raises(httpx.ReadTimeout):
        post(server, body, timeout=httpx.Timeout(60, read=1.5))
    left = time.monotonic()
    while health(server)["slots_processing"] and time.monotonic() - left < 60:
        time.sleep(0.1)
    assert health(server)["slots_processing"] == 0
    # One decode step per token: had the request run on after its client left, it would have
    # taken 480 steps before freeing its slot.
    assert health(server)["decode_steps"] - steps_before < 400


def test_a_hundred_clients_at_once_all_get_an_http_answer(server):
    codes: list[int | str] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            code: int | str = post(server, {**HI, "max_tokens": 1}).status_code
        except httpx.HTTPError as error:
            code = type(error).__name__
        with lock:
            codes.append(code)

    threads = [threading.Thread(target=one) for _ in range(100)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(codes) == 100 and set(codes) <= {200, 429}, sorted(map(str, codes))
    assert codes.count(200) >= 2


def test_connections_beyond_the_cap_get_429(smollm2_path, quill_home, tmp_path):
    process, url = start_server(quill_home, tmp_path, "--max-connections", "3", "--ctx", "64")
    idle = [socket.create_connection(("127.0.0.1", port_of(url))) for _ in range(3)]
    try:
        time.sleep(0.3)
        reply = raw_exchange(url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, body = status_and_json(reply)
        assert status == 429 and body["error"]["code"] == "too_many_connections"
        for sock in idle:
            sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        # Without --cors, no CORS header for anyone.
        plain = httpx.get(f"{url}/v1/models", headers={"Origin": ALLOWED_ORIGIN}, timeout=10)
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers
    finally:
        process.terminate()
        process.wait(timeout=30)


# --- shutdown -------------------------------------------------------------------------------------


def stream_events(url: str, events: list[str], started: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as error:
        events.append(f"client error: {error!r}")
    started.set()


def test_sigterm_drains_streams_and_exits_0(smollm2_path, quill_home, tmp_path):
    process, url = start_server(
        quill_home, tmp_path, "--parallel", "2", "--ctx", "512", "--drain-timeout", "1.5",
        "--threads", "1",
    )  # fmt: skip
    streams: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=stream_events, args=(url, streams[i], started[i])) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60)
    time.sleep(0.3)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.HTTPError):  # draining: no new connections
        httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=5).raise_for_status()
    assert process.wait(timeout=15) == 0
    # Streams end at 1.2 s, leaving the rest of the drain timeout for closing and freeing; the
    # margin over 1.5 s is for a machine as busy as CI's can be.
    assert time.monotonic() - signalled < 1.5 + 5
    for thread in threads:
        thread.join(timeout=10)
    for events in streams:
        last = json.loads(events[-1]) if events[-1] != "[DONE]" else "[DONE]"
        assert last == "[DONE]" or last["error"]["code"] == "server_shutting_down", events[-3:]
    assert "Traceback" not in process.stderr.read()


def test_ctrl_c_on_an_idle_server_exits_0_without_a_traceback(smollm2_path, quill_home, tmp_path):
    process, url = start_server(quill_home, tmp_path, "--ctx", "64")
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=15) == 0
    stderr = process.stderr.read()
    assert "Traceback" not in stderr and "stopped by SIGINT" in stderr


def test_importing_the_cli_does_not_import_the_http_stack():
    code = (
        "import sys, cli.app; "
        "print(sorted(m for m in ('uvicorn', 'starlette') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env=dict(os.environ),
    )  # fmt: skip
    assert result.stdout.strip() == "[]"


def test_streams_end_before_the_drain_timeout_to_leave_time_for_teardown():
    from cli.api.http import streams_end_after

    assert streams_end_after(30) == 29
    assert streams_end_after(5) == 4
    assert streams_end_after(1.5) == pytest.approx(1.2)
    assert streams_end_after(0) == 0

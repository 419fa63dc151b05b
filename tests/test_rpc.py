"""Past one machine (issue 28): two `quill rpc-server` processes on 127.0.0.1 hold SmolLM2's
layers for run, chat, serve, bench and inspect through llama.cpp's RPC backend; unreachable,
wrong-protocol, busy and killed servers end in one line and exit code 9, never llama.cpp's
abort. Every client that reaches llama.cpp runs in a child process: an RPC server serves one
client at a time, and a client process keeps its connections while it lives."""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cli.app import app
from cli.engine import rpc, rpcrelay
from cli.errors import EXIT_RPC, EXIT_USAGE

from conftest import QUILL, quill_env, run_quill, start_server
from neartie import assert_near
from reference import Reference

PROMPT = "Name three primary colors."


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_rpc_server(
    quill_home: Path, *args: str, host: str = "127.0.0.1", relay: bool = False, port: int = 0
) -> tuple[subprocess.Popen, str]:
    """`quill rpc-server --host HOST --port P --threads 1 ARGS`, once it answers the handshake;
    relay: through the relay it uses where it cannot serve in place (QUILL_RPC_RELAY=1); port:
    P (default: a free one)."""
    port = port or free_port()
    process = subprocess.Popen(
        [QUILL, "rpc-server", "--host", host, "--port", str(port), "--threads", "1", *args],
        env=quill_env(quill_home) | ({"QUILL_RPC_RELAY": "1"} if relay else {}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            rpc.probe(endpoint, timeout_s=2)
            return process, endpoint
        except Exception:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"quill rpc-server did not start: {process.communicate()[1]}")
            time.sleep(0.2)


def stop(process: subprocess.Popen, how: int = signal.SIGTERM) -> tuple[int, str, str]:
    process.send_signal(how)
    out, err = process.communicate(timeout=30)
    return process.returncode, out, err


@pytest.fixture(scope="module")
def servers(quill_home: Path) -> Iterator[tuple[str, str]]:
    started = [start_rpc_server(quill_home) for _ in range(2)]
    yield tuple(endpoint for _, endpoint in started)
    for process, _ in started:
        stop(process)


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> Iterator[Reference]:
    ref = Reference(smollm2_path)
    yield ref
    ref.close()


def quill(quill_home: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_quill(quill_home, *args, timeout=timeout)


def model_buffers(log: str) -> dict[str, float]:
    """llama.cpp's 'RPC0[127.0.0.1:P] model buffer size = X MiB' lines: {device: MiB}."""
    found = re.findall(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB", log)
    return {device: float(mib) for device, mib in found}


def test_run_splits_the_layers_over_both_servers_as_inspect_plans(
    quill_home, smollm2_path, servers, reference
):
    both = ",".join(servers)
    ran = quill(quill_home, "run", "--rpc", both, "--temperature", "0", "-n", "32",
                "--json", "--verbose", PROMPT)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["rpc"] == list(servers)
    assert out["gpu_layers"] == 30  # every layer left the host
    # RPC is asynchronous: the prefill's clock stops when the servers are done, not when
    # llama_decode returns (it read 1.6x the true speed before). A prompt long enough that a
    # hiccup of this 2-core machine between prefill and first token (90 ms was seen) cannot
    # look like that.
    long = quill(quill_home, "run", "--rpc", both, "-n", "1", "--json", "--raw",
                 "Tell me about the sea. " * 80)  # fmt: skip
    timed = json.loads(long.stdout)
    assert 0.8 * timed["ttft_s"] <= timed["prefill_s"] <= timed["ttft_s"], timed
    buffers = model_buffers(ran.stderr)
    on_servers = {device: mib for device, mib in buffers.items() if device.startswith("RPC")}
    assert {d.split("[")[1].rstrip("]") for d in on_servers} == set(servers), buffers
    tokens = reference.tokenize(reference.chat([("user", PROMPT)]), True)
    assert_near(reference, tokens, out["text"])

    planned = quill(quill_home, "inspect", str(smollm2_path), "--rpc", both, "--json")
    assert planned.returncode == 0, planned.stderr
    split = json.loads(planned.stdout)["rpc_split"]
    assert [share["device"] for share in split] == ["CPU", *(f"{s}#0" for s in servers)]
    assert split[0]["layers"] == []  # the input embeddings alone stay on the host
    held = [layer for share in split[1:] for layer in share["layers"]]
    assert held == list(range(31)) and all(share["layers"] for share in split[1:])
    for share in split[1:]:  # the plan's weights are what llama.cpp put there
        device = next(d for d in on_servers if share["device"].split("#")[0] in d)
        assert abs(share["weights_bytes"] / 2**20 - on_servers[device]) < 1.0, (share, buffers)

    shown = quill(quill_home, "inspect", str(smollm2_path), "--rpc", both)
    assert "split over the RPC servers" in shown.stdout and servers[1] in shown.stdout


def test_bench_and_serve_answer_through_the_servers(quill_home, smollm2_path, servers, tmp_path):
    both = ",".join(servers)
    # Two KV types: two loads in one process, the second on servers it already holds.
    bench = quill(quill_home, "bench", str(smollm2_path), "--rpc", both, "-p", "32", "-n", "8",
                  "-r", "1", "--kv-type", "f16,q8_0", "--json")  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    rows = json.loads(bench.stdout)["rows"]
    assert [(row["test"], row["kv_type"]) for row in rows] == [
        ("pp32", "f16"),
        ("tg8", "f16"),
        ("pp32", "q8_0"),
        ("tg8", "q8_0"),
    ]
    assert all(row["rpc"] == list(servers) and row["tokens_per_s"] > 0 for row in rows)

    process, url = start_server(quill_home, tmp_path, str(smollm2_path), "--rpc", both)
    try:
        assert_answers(url)
    finally:
        process.terminate()
        process.wait(timeout=30)


def assert_answers(url: str) -> None:
    import httpx2 as httpx

    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] > 0


def test_serve_outlives_a_lost_rpc_server(quill_home, smollm2_path, tmp_path):
    """serve --rpc holds its models in a child serve: a lost RPC server ends the child's streams
    with an error event, the port goes on answering (with the reason), and once the RPC server
    is back the next request is served by a new child."""
    import httpx2 as httpx

    lender, endpoint = start_rpc_server(quill_home)
    process, url = start_server(quill_home, tmp_path, str(smollm2_path), "--rpc", endpoint)
    try:
        story = {"messages": [{"role": "user", "content": "Tell a long story."}], "stream": True,
                 "max_tokens": 2000, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=story, timeout=60) as reply:
            frames = (line[6:] for line in reply.iter_lines() if line.startswith("data: "))
            while not json.loads(next(frames))["choices"][0]["delta"].get("content"):
                pass
            lender.kill()  # mid-reply
            lender.wait()
            rest = list(frames)
        assert "[DONE]" not in rest and json.loads(rest[-1])["error"]["code"] == (
            "model_process_ended"
        )
        asked = time.monotonic()
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503, health.text
        assert f"RPC server {endpoint} cannot be reached" in health.json()["error"]["message"]
        assert health.headers["retry-after"] == "2"
        assert time.monotonic() - asked < 10
        lender, _ = start_rpc_server(quill_home, port=int(endpoint.rsplit(":", 1)[1]))
        time.sleep(2)  # the supervisor's RETRY_S after the start that failed
        assert_answers(url)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
        stop(lender)
    assert process.returncode == 0, err
    assert f"RPC server {endpoint} was lost mid-run" in err
    assert "the model process ended (exit code 9); starting it again" in err
    assert err.splitlines()[-1] == "stopped by SIGTERM: drained", err


def test_rpc_server_listens_on_loopback_and_stops_on_sigterm(quill_home):
    process, endpoint = start_rpc_server(quill_home)
    port = int(endpoint.rsplit(":", 1)[1])
    listening = {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(process.pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }
    # the port asked for, and llama.cpp's own server behind it, on loopback too
    assert ("127.0.0.1", port) in listening and {ip for ip, _ in listening} == {"127.0.0.1"}
    assert len(listening) == 2, listening
    taken = quill(quill_home, "rpc-server", "--port", str(port))
    assert taken.returncode == EXIT_RPC and taken.stderr.count("\n") == 1
    assert "cannot listen there (Address already in use)" in taken.stderr
    code, out, err = stop(process)
    assert code == 0 and out == "", err
    # nothing from llama.cpp's loop, whose accept() the signal must not interrupt
    assert err.splitlines()[1:] == ["quill rpc-server: stopped (SIGTERM)"], err


def test_mem_is_the_memory_a_server_offers_and_moves_the_split(quill_home, smollm2_path):
    process, small = start_rpc_server(quill_home, "--mem", "64MiB", "--verbose")
    other, large = start_rpc_server(quill_home, "--mem", "192MiB")
    try:
        [device] = rpc.probe(small)
        assert device.free_bytes == device.total_bytes == 64 * 2**20
        planned = quill(quill_home, "inspect", str(smollm2_path), "--rpc", f"{small},{large}",
                        "--json")  # fmt: skip
        assert planned.returncode == 0, planned.stderr
        shares = {s["device"]: len(s["layers"]) for s in json.loads(planned.stdout)["rpc_split"]}
        assert shares == {"CPU": 0, f"{small}#0": 8, f"{large}#0": 23}  # 1:3 of 31 slots
    finally:
        stop(other)
        code, out, err = stop(process)
    # --verbose: llama.cpp's own server lines, on stderr like every log
    assert code == 0 and out == "" and "Accepted client connection" in err, err


def past_hello(endpoint: str) -> socket.socket:
    """A connection whose hello the server answered, as llama.cpp's client opens one."""
    conn = socket.create_connection(rpcrelay.split_endpoint(endpoint), timeout=10)
    conn.sendall(struct.pack("<BQ", rpcrelay.HELLO, rpcrelay.CAPS_SIZE) + bytes(24))
    reply = b""
    while len(reply) < 8 + 4 + rpcrelay.CAPS_SIZE:
        chunk = conn.recv(64)
        assert chunk, "the server closed the connection at the hello"
        reply += chunk
    return conn


def rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def established(pid: int) -> int:
    connections = psutil.Process(pid).net_connections(kind="tcp")
    return sum(c.status == psutil.CONN_ESTABLISHED for c in connections)


@pytest.mark.parametrize("relay", [False, True], ids=["in place", "relay"])
def test_a_request_larger_than_the_server_serves_is_refused_before_allocating(
    quill_home, tiny_path, relay
):
    process, endpoint = start_rpc_server(quill_home, "--mem", "64MiB", relay=relay)
    set_tensor = 6  # RPC_CMD_SET_TENSOR: llama.cpp's server allocates what its size says
    try:
        before = rss_bytes(process.pid)
        # 1 TiB, which malloc refuses anyway, and 512 MiB, which it would grant
        for declared in (2**40, 512 * 2**20):
            with past_hello(endpoint) as conn:
                # In place, llama.cpp's server reads the client's own socket; a relay adds
                # its own connection to llama.cpp's server, and that one's other end.
                assert established(process.pid) == (3 if relay else 1)
                conn.sendall(struct.pack("<BQ", set_tensor, declared))
                time.sleep(1)
                assert rss_bytes(process.pid) - before < 32 * 2**20, declared
                assert conn.recv(1) == b"", "the connection stayed open"
        ran = quill(quill_home, "run", str(tiny_path), "--rpc", endpoint, "-n", "4", "--json",
                    PROMPT, timeout=120)  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        assert json.loads(ran.stdout)["rpc"] == [endpoint]
    finally:
        code, _, err = stop(process)
    refused = [line for line in err.splitlines() if " refused " in line]
    assert len(refused) == 2, err
    assert "a 1.0 TiB message (command 6), more than the 128.0 MiB this server" in refused[0]
    assert code == 0


def test_a_connection_that_says_nothing_does_not_hold_the_server(quill_home, tiny_path):
    process, endpoint = start_rpc_server(quill_home)
    try:
        silent = socket.create_connection(rpcrelay.split_endpoint(endpoint))
        connected = time.monotonic()
        ran = quill(quill_home, "run", str(tiny_path), "--rpc", endpoint, "-n", "4", PROMPT,
                    timeout=120)  # fmt: skip
        assert ran.returncode == 0, ran.stderr
        silent.settimeout(30)
        assert silent.recv(1) == b""  # dropped after its time for a hello
        dropped_after = time.monotonic() - connected
        silent.close()
    finally:
        _, _, err = stop(process)
    assert rpcrelay.HELLO_TIMEOUT_S - 0.5 < dropped_after < rpcrelay.HELLO_TIMEOUT_S + 5
    assert "no hello within 5 s" in err


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_an_ipv6_server_is_reached_in_brackets(quill_home, tiny_path):
    process, endpoint = start_rpc_server(quill_home, host="::1")
    assert endpoint.startswith("[::1]:")
    try:
        ran = quill(quill_home, "run", str(tiny_path), "--rpc", endpoint, "-n", "4", "--json",
                    "--verbose", PROMPT, timeout=120)  # fmt: skip
    finally:
        stop(process)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["rpc"] == [endpoint]
    # llama.cpp's client dials IPv4 only: it reached the server through quill's loopback relay
    held = [mib for device, mib in model_buffers(ran.stderr).items() if device.startswith("RPC")]
    assert held and all(mib > 0 for mib in held), ran.stderr


def test_another_address_only_when_typed_and_with_a_warning(quill_home):
    port = free_port()
    process = subprocess.Popen(
        [QUILL, "rpc-server", "--host", "0.0.0.0", "--port", str(port), "--threads", "1"],
        env=quill_env(quill_home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            connections = psutil.Process(process.pid).net_connections(kind="tcp")
            listening = {c.laddr for c in connections if c.status == psutil.CONN_LISTEN}
            if len(listening) == 2:  # quill's, and llama.cpp's server's own (idle in place)
                break
            time.sleep(0.2)
        assert {(a.ip, a.port == port) for a in listening} == {("0.0.0.0", True),
                                                                ("127.0.0.1", False)}  # fmt: skip
    finally:
        code, _, err = stop(process, signal.SIGINT)  # Ctrl-C
    assert err.splitlines()[-1] == "quill rpc-server: stopped (SIGINT)", err
    warning = [line for line in err.splitlines() if "no authentication" in line]
    assert len(warning) == 1 and "SSH tunnel" in warning[0], err
    assert code == 0


def test_unreachable_server_is_one_line_before_llama_cpp_touches_it(runner, smollm2_path):
    closed = f"127.0.0.1:{free_port()}"
    result = runner.invoke(app, ["run", "--rpc", closed, "-n", "4", PROMPT])
    assert result.exit_code == EXIT_RPC
    assert result.stderr.strip().splitlines() == [
        f"quill: error: RPC server {closed} cannot be reached (Connection refused)"
    ]


def fake_server(answer: bytes) -> tuple[socket.socket, str]:
    """A listener that answers the first 33 bytes it gets (a HELLO) with answer, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(33)
                conn.sendall(answer)
                time.sleep(0.5)

    threading.Thread(target=serve, daemon=True).start()
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24), "speaks RPC protocol 6.1.0"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "is not a llama.cpp RPC server of protocol 7.x"),
    ],
)
def test_another_protocol_is_refused_at_the_handshake(runner, smollm2_path, answer, expected):
    _, endpoint = fake_server(answer)
    result = runner.invoke(app, ["inspect", str(smollm2_path), "--rpc", endpoint])
    assert result.exit_code == EXIT_RPC
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"quill: error: RPC server {endpoint} {expected}"
    )


def test_a_server_that_never_answers_is_a_timeout_not_a_hang(runner, smollm2_path):
    listener = socket.create_server(("127.0.0.1", 0))  # accepts into its backlog, says nothing
    endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
    with listener:
        started = time.monotonic()
        result = runner.invoke(app, ["inspect", str(smollm2_path), "--rpc", endpoint])
    assert result.exit_code == EXIT_RPC and time.monotonic() - started < 30
    assert "did not answer the handshake" in result.stderr


@pytest.mark.parametrize("command", ["run", "chat", "bench"])
def test_rpc_and_endpoint_do_not_go_together(runner, command):
    result = runner.invoke(app, [command, "--rpc", "127.0.0.1:50052", "--endpoint",
                                 "http://127.0.0.1:8080/v1"], input="")  # fmt: skip
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith("quill: error: --rpc splits a model loaded here"), result.stderr


@pytest.mark.parametrize("value", ["localhost", "host:port", "a:1,a:1", ":50052", "h:70000", "h:٣"])
def test_rpc_takes_host_port_pairs(runner, value):
    result = runner.invoke(app, ["run", "--rpc", value, "-n", "1", PROMPT])
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith("quill: error: --rpc ") and len(result.stderr.splitlines()) == 1


def test_a_server_lost_mid_reply_is_named_and_the_chat_keeps_its_turns(
    quill_home, smollm2_path, tmp_path
):
    (first, a), (second, b) = start_rpc_server(quill_home), start_rpc_server(quill_home)
    transcript = tmp_path / "chat.json"
    command = [QUILL, "chat", str(smollm2_path), "--rpc", f"{a},{b}", "--transcript",
               str(transcript), "--temperature", "0", "-n", "2000"]  # fmt: skip
    chat = subprocess.Popen(
        command,
        env=quill_env(quill_home),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    printed = bytearray()

    def read() -> None:
        while chunk := chat.stdout.read1(64):
            printed.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_for(done, what: str) -> None:
        deadline = time.monotonic() + 120
        while not done():
            assert chat.poll() is None, f"chat ended before {what}: {chat.stderr.read()}"
            assert time.monotonic() < deadline, f"no {what} in 120 s"
            time.sleep(0.05)

    try:
        chat.stdin.write(b"Say hello.\n")
        chat.stdin.flush()
        wait_for(lambda: transcript.exists() and "assistant" in transcript.read_text(), "reply")
        first_reply = len(printed)
        chat.stdin.write(b"Write a long story about a lighthouse keeper, in ten chapters.\n")
        chat.stdin.flush()
        wait_for(lambda: len(printed) > first_reply + 40, "second reply")
        second.kill()  # mid-reply
        _, err = chat.communicate(timeout=60)
    finally:
        chat.kill()
        stop(first)
        second.kill()
    err = err.decode()
    assert chat.returncode == EXIT_RPC, err
    assert "Traceback" not in err and "ggml_print_backtrace" not in err
    assert err.strip().splitlines()[-1].startswith(f"quill: error: RPC server {b} was lost mid-run")
    turns = json.loads(transcript.read_text())["messages"]
    hello = next(i for i, m in enumerate(turns) if m["content"] == "Say hello.")
    assert turns[hello + 1]["role"] == "assistant" and turns[hello + 1]["content"]


def test_the_install_has_rpc_and_version_says_so(runner):
    """The README's install builds llama-cpp-python with -DGGML_RPC=on (past pip's wheel
    cache): every test above needs it, so a build without it fails here, not silently."""
    assert rpc.supports_rpc()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and "RPC on" in result.stdout

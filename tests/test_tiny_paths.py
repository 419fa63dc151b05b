"""Paths the slow tier takes on SmolLM2, taken on the tiny model, so that the fast tier
(`pytest -m "not slow"`) runs every module of cli/ and quant/: quill tokenize, the --endpoint
client of run, chat and bench against quill serve with structured output, `python -m cli`, and
quant's names loaded on first use. Properties only: no text is compared across two paths."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

import quant
from cli.app import app

from conftest import KEY, quill_env, start_server

TEXT = 'Tokens are not characters: 一个常用汉字, {"a": 1}, 🦙'


@pytest.fixture(scope="module")
def tiny_server(tiny_path, quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home, tmp_path_factory.mktemp("serve-tiny"), str(tiny_path),
        "--parallel", "2", "--ctx", "1024", "--api-key", KEY,
    )  # fmt: skip
    yield f"{url}/v1"
    process.terminate()
    process.wait(timeout=30)


def test_run_endpoint_on_the_tiny_server_reports_the_reply(runner, tiny_server):
    args = ["run", "--endpoint", tiny_server, "--api-key", KEY, "--seed", "1", "-n", "8"]
    result = runner.invoke(app, [*args, "--json", "hello there"])
    assert result.exit_code == 0, result.stderr
    reply = json.loads(result.stdout)
    assert reply["path"] == tiny_server and reply["generation_tokens"] > 0 and reply["text"]
    assert reply["ttft_s"] > 0 and reply["prompt_tokens"] > 2
    # The schema goes to the server as response_format; its grammar holds the tiny model.
    held = runner.invoke(app, [*args[:-1], "60", "--schema", "ok bool", "--no-stats", "Say."])
    assert held.exit_code == 0, held.stderr
    assert isinstance(json.loads(held.stdout)["ok"], bool)
    refused = runner.invoke(app, ["run", "--endpoint", tiny_server, "hi"])
    assert refused.exit_code == 6 and "pass --api-key" in refused.stderr


def test_run_raw_endpoint_sends_the_prompt_as_it_is(runner, tiny_server, tiny_path):
    """--raw with --endpoint goes to /v1/completions: the server prefills exactly the prompt's
    own tokens, where a chat message comes wrapped in its template."""
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    args = ["run", "--endpoint", tiny_server, "--api-key", KEY, "--seed", "1", "-n", "4", "--json"]
    raw = runner.invoke(app, [*args, "--raw", "hello there"])
    assert raw.exit_code == 0, raw.stderr
    chat = runner.invoke(app, [*args, "hello there"])
    with Engine(tiny_path, LoadOptions(n_ctx=64, threads=1)) as engine:
        own = len(engine.tokenize("hello there"))
    assert json.loads(raw.stdout)["prompt_tokens"] == own < json.loads(chat.stdout)["prompt_tokens"]
    assert json.loads(raw.stdout)["kv_cache_type"] is None  # the server's own


def test_run_raw_endpoint_without_completions_is_one_error_line(runner):
    """A server that has only chat completions: --raw is refused in one line, exit 6."""
    import http.server
    import threading

    class ChatOnly(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.dumps({"error": {"message": "Not Found"}}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ChatOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        result = runner.invoke(app, ["run", "--endpoint", url, "-m", "m", "--raw", "hi"])
    finally:
        server.shutdown()
    assert result.exit_code == 6
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "/v1/completions" in lines[0] and "drop --raw" in lines[0], lines


def test_chat_and_bench_endpoint_on_the_tiny_server(runner, tiny_server, quill_home, tmp_path):
    transcript = tmp_path / "remote.json"
    # python -m cli: the module entry point (cli/__main__.py), which the console script mirrors.
    result = subprocess.run(
        [sys.executable, "-m", "cli", "chat", "--endpoint", tiny_server, "--api-key", KEY,
         "--seed", "2", "-n", "6", "--transcript", str(transcript)],
        input="hello there\n/set threads 2\n/show\nthanks\n", capture_output=True, text=True,
        env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    messages = json.loads(transcript.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2
    assert len(re.findall(r"prefill \d+ new tokens", result.stderr)) == 2
    assert f"the server at {tiny_server.removesuffix('/v1')}" in result.stderr
    assert "chooses its own threads (quill serve -t N sets them)" in result.stderr
    # /show: what the server keeps is not shown as quill's (no KV cache or threads lines).
    shown = result.stderr[result.stderr.index("model      ") :]
    assert shown.startswith("model      ") and f" at {tiny_server}" in shown.splitlines()[0]
    assert "(the server applies its own top_k and min_p)" in shown
    assert "(the server keeps the cache)" in shown and "on overflow" not in shown
    assert "KV cache" not in shown and "threads    " not in shown
    bench = runner.invoke(
        app, ["bench", "--endpoint", tiny_server, "--api-key", KEY, "-p", "32", "-n", "4",
              "-r", "1", "--json"],
    )  # fmt: skip
    assert bench.exit_code == 0, bench.stderr
    rows = {row["test"]: row for row in json.loads(bench.stdout)["rows"]}
    assert set(rows) == {"pp32", "tg4"} and rows["tg4"]["tokens_per_s"] > 0


def test_quant_names_load_on_first_use():
    """`from quant import plan` works without importing every submodule up front."""
    assert "plan" in dir(quant) and "quantize" in quant.__all__
    from quant import memory

    assert quant.plan is memory.plan and quant.parse_size("1KiB") == 1024
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = quant.nothing


@pytest.mark.parametrize(("host", "warned"), [("127.0.0.2", False), ("0.0.0.0", True)])
def test_serve_warns_of_a_keyless_server_only_beyond_loopback(
    tiny_path, quill_home, tmp_path, host, warned
):
    """127.0.0.2 is loopback (the Host check treats it so): no warning there, where the warning
    once knew only 127.0.0.1, localhost and ::1."""
    process, _ = start_server(quill_home, tmp_path, str(tiny_path), "--host", host, "--ctx", "256")
    process.terminate()
    _, stderr = process.communicate(timeout=30)
    assert ("without --api-key: anyone who can reach this port" in stderr) == warned, stderr


def test_serve_refuses_a_bad_memory_limit_before_fetching_a_model(runner):
    """--memory-limit is read with the other options, not after the models are downloaded."""
    result = runner.invoke(app, ["serve", "no-such-model", "--memory-limit", "12XB", "--offline"])
    assert result.exit_code == 2, result.stderr
    assert "--memory-limit" in result.stderr and "no-such-model" not in result.stderr

"""Real agent clients against quill serve (issue 45): Claude Code (`claude -p`, the Anthropic
Messages API through ANTHROPIC_BASE_URL) and Codex CLI (`codex exec`, the OpenAI Responses API
through a model provider configured for quill), each installed from the npm registry into
benchmarks/.build/npm, each given a one-shot prompt. What is checked is the protocol: the
client exits 0 and prints the model's answer, with no client error. (A 135M model's answer
to an agent's 20,000-token system prompt is poor; that is not what is measured.)

The server's log lines (one per request: route, status, prompt tokens) and what each client
printed go to the results, so that a failure says which request broke.

Usage (inside quill's venv; npm on PATH; the first run downloads the clients):
  python -m benchmarks.agent_clients [--model MODEL] [--ctx 32768] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from benchmarks.harness import QUILL, ROOT, machine_line, quill_commit, serving, users_env

NPM = ROOT / "benchmarks" / ".build" / "npm"
CLIENTS = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0"}
KEY = "agent-clients-key"
MAX_OUTPUT_TOKENS = 512
PROMPT = "Reply with one short sentence: what is the capital of France?"


def installed(name: str) -> Path:
    binary = NPM / "node_modules" / ".bin" / name
    if not binary.exists():
        NPM.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(NPM), *CLIENTS.values()],
            check=True,
        )
    return binary


def claude(url: str, model: str, home: Path) -> subprocess.CompletedProcess:
    """Claude Code in print mode, every model it would pick mapped to quill's."""
    env = dict(
        os.environ,
        HOME=str(home),
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY=KEY,
        ANTHROPIC_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        # A small model rarely stops by itself: its reply is bounded, or it decodes for minutes.
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_OUTPUT_TOKENS),
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
    )
    command = [str(installed("claude")), "-p", PROMPT, "--model", model, "--max-turns", "1"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def codex(url: str, model: str, home: Path) -> subprocess.CompletedProcess:
    """codex exec with a provider named quill that speaks the Responses API."""
    env = dict(os.environ, HOME=str(home), CODEX_HOME=str(home / ".codex"), QUILL_KEY=KEY)
    (home / ".codex").mkdir(exist_ok=True)
    provider = (
        f'{{ name = "quill", base_url = "{url}/v1", wire_api = "responses", '
        'env_key = "QUILL_KEY", request_max_retries = 0, stream_max_retries = 0 }'
    )
    command = [
        str(installed("codex")), "exec", "--skip-git-repo-check",
        "-c", f"model_providers.quill={provider}", "-c", "model_provider=quill",
        "-m", model, "-s", "read-only", PROMPT,
    ]  # fmt: skip
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=900, cwd=str(home)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ctx", type=int, default=32768, help="the agents' prompts are long")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    results: dict = {"machine": machine_line(), "quill": quill_commit(), "clients": CLIENTS}
    for name in CLIENTS:
        installed(name)
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "serve.log"
        # Greedy (neither client sends a temperature): the run repeats, and the 135M model's
        # greedy answer ends by itself where a sampled one may ramble to the token limit.
        command = [QUILL, "serve", args.model, "--ctx", str(args.ctx), "--parallel", "1",
                   "--api-key", KEY, "--temp", "0"]  # fmt: skip
        with log.open("w") as stderr, serving(command, users_env(), stderr=stderr) as (_, url):
            listed = httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}, timeout=30)
            model = listed.json()["data"][0]["id"]
            for name, client in (("claude", claude), ("codex", codex)):
                home = Path(folder) / f"home-{name}"
                home.mkdir()
                started = time.perf_counter()
                done = client(url, model, home)
                results[name] = {
                    "command": " ".join([*done.args[:2], "..."]),
                    "exit": done.returncode,
                    "seconds": round(time.perf_counter() - started, 1),
                    "stdout": done.stdout[-2000:],
                    "stderr": done.stderr[-3000:],
                }
                print(f"{name}: exit {done.returncode}\n{done.stdout[-800:]}", file=sys.stderr)
        results["server_log"] = log.read_text()[-6000:]
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

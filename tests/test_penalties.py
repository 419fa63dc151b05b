"""Sampling penalties, on the real SmolLM2: --repeat-penalty in run, the frequency and presence
penalties reaching the sampler (a negative one favouring repeats), /set repeat_penalty in a chat
that goes on, and a server applying each per request, refusing one out of range with a 400 and
serving on (each once crashed, issue 14)."""

from __future__ import annotations

import json
import subprocess

import httpx2 as httpx

from cli.app import app
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

from conftest import QUILL, quill_env, start_server


def test_repeat_penalty_runs(runner, smollm2_path):
    args = ["run", "--repeat-penalty", "1.1", "--temp", "0", "-n", "12", "--json", "Count: 1 1 1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["generation_tokens"] >= 1


def test_frequency_and_presence_penalties_reach_the_sampler(smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=512, threads=2)) as engine:
        prompt = engine.tokenize("1 2 1 2 1 2 1 2 1 2 1 2 1 2")

        def repeats(**penalties: float) -> int:
            """How many of 16 greedy tokens were seen before (in the prompt or the reply)."""
            sampling = SamplingParams(temperature=0, **penalties)
            tokens = [e.token for e in engine.stream_generate(prompt, 16, sampling)]
            return sum(t in prompt or t in tokens[:i] for i, t in enumerate(tokens))

        plain = repeats()
        assert plain >= 12  # greedy SmolLM2 goes on counting 1 2 1 2
        for penalties in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
            assert repeats(**penalties) <= plain // 2, penalties
        assert repeats(frequency_penalty=-2.0) >= plain  # a negative penalty favours repeats


def test_chat_set_repeat_penalty_keeps_chatting(smollm2_path, quill_home, tmp_path):
    transcript = tmp_path / "chat.json"
    result = subprocess.run(
        [QUILL, "chat", "--temperature", "0", "-n", "8", "--transcript", str(transcript)],
        input="/set repeat_penalty 1.1\nSay hello.\n",
        capture_output=True, text=True, env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    messages = json.loads(transcript.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"]


def test_serve_applies_penalties_and_keeps_serving(smollm2_path, quill_home, tmp_path):
    process, url = start_server(quill_home, tmp_path, "--parallel", "2", "--ctx", "256")
    try:

        def ask(**extra: float) -> str:
            response = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "1 2 1 2 1 2 1 2 1 2 1 2 1 2", "max_tokens": 12,
                      "temperature": 0, **extra},
                timeout=30,  # a dead scheduler would leave this hanging
            )  # fmt: skip
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        plain = ask()
        assert ask(repeat_penalty=1.1)
        assert ask(frequency_penalty=2.0) != plain
        assert ask(presence_penalty=2.0) != plain
        assert ask() == plain  # the scheduler lives on, and unpenalized requests are unchanged
        bad = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "x", "max_tokens": 2, "frequency_penalty": 3},
            timeout=30,
        )
        assert bad.status_code == 400 and "frequency_penalty" in bad.text
    finally:
        process.terminate()
        process.wait(timeout=30)

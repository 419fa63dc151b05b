"""Files quill reads back are untrusted input: a crafted prompt-cache header is removed with one
warning and the run goes on, a read-only cache directory is reported as it is, a model edited in
place (its mtime restored) is not served a stale cache, the model-hash memo checks a sample of the
content and, damaged, costs a hash and not the run, and a crafted chat transcript is refused in one
line and never written over. Each test runs the CLI as a user meets it."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.app import app
from cli.store.promptcache import cache_dir, files, model_sha256, read_header

from refusals import home as home
from refusals import one_short_error_line as one_error_line

GREEDY = ["--temperature", "0", "--raw", "-n", "6", "-t", "1"]  # one thread count: one compute path


def long_prompt() -> str:
    """Some 600 tokens: past the 512 a prompt needs to be cached."""
    lines = (f"Line {i} of the ledger says the river rose {i * 7} inches." for i in range(48))
    return " ".join(lines)


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

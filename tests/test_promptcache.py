"""quill run's prompt cache on disk: a long prompt's KV state is kept under QUILL_HOME and a
later run that starts with it loads it instead of prefilling; the output is this machine's greedy
reply with or without the cache (up to near-ties: the cached run decodes the prompt's tail in
another batch shape). Foreign, damaged and unwritable caches never break a run."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
from pathlib import Path

import pytest

from cli.app import app
from cli.engine.kvcache import EXACT_BATCH
from cli.store.promptcache import cache_dir, files, read_header

from conftest import QUILL, quill_env
from neartie import assert_near
from reference import Reference

# One thread count for every run: runs that take the same path print the same text.
GREEDY = ["--temperature", "0", "--raw", "-n", "12", "-t", "2"]


def long_prompt(seed: int = 0, sentences: int = 45) -> str:
    """Some 600+ tokens of text (past the 512-token threshold), different for each seed."""
    subjects = ["The river", "A merchant", "The old bridge", "Our neighbour", "The library"]
    verbs = ["remembers", "carries", "watches", "describes", "forgets"]
    objects = ["the winter market", "a quiet harbour", "seven green lanterns", "the long road"]
    lines = [
        f"{subjects[(i + seed) % 5]} {verbs[(i * 3 + seed) % 5]} {objects[(i * 7 + seed) % 4]} "
        f"in year {1800 + i * 3 + seed}."
        for i in range(sentences)
    ]
    return " ".join(lines) + "\nIn short,"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """A QUILL_HOME of the test's own: the cache directory starts empty."""
    folder = tmp_path / "home"
    monkeypatch.setenv("QUILL_HOME", str(folder))
    return folder


def run(runner, model: Path, *args: str, prompt: str) -> tuple[dict, str]:
    result = runner.invoke(app, ["run", "--json", "-m", str(model), *GREEDY, *args, prompt])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def cache_files(home: Path) -> list[Path]:
    return files(cache_dir(home))


def assert_replies_near(model: Path, prompt: str, *texts: str, kv: str = "f16") -> None:
    """Each text is this machine's greedy reply to the raw prompt, up to near-ties."""
    reference = Reference(model, n_ctx=2048, threads=2, kv_type=kv)
    try:
        assert_near(reference, reference.tokenize(prompt, add_special=True), *texts)
    finally:
        reference.close()


@pytest.mark.parametrize(
    ("model", "kv"),
    [("tiny_path", "f16"), ("tiny32_path", "q8_0"), ("smollm2_path", "f16")],
)
def test_a_second_run_loads_the_prompt_and_answers_the_same(runner, home, request, model, kv):
    path = request.getfixturevalue(model)
    kv_args = ["--kv-type", kv]
    prompt = long_prompt()
    first, _ = run(runner, path, *kv_args, prompt=prompt)
    assert first["prompt_tokens"] >= 512 and first["cached_prompt_tokens"] == 0
    assert len(cache_files(home)) == 1
    # The second run prints the stats: it says how much came from the cache.
    result = runner.invoke(app, ["run", "-m", str(path), *GREEDY, *kv_args, prompt])
    assert result.exit_code == 0, result.stderr
    # The last EXACT_BATCH prompt tokens are decoded again, as one batch: the same logits.
    assert f"{first['prompt_tokens'] - EXACT_BATCH} tokens from cache in" in result.stderr
    assert result.stdout.endswith("\n")
    again, _ = run(runner, path, *kv_args, prompt=prompt)
    assert again["cached_prompt_tokens"] == first["prompt_tokens"] - EXACT_BATCH
    uncached, _ = run(runner, path, *kv_args, "--no-cache", prompt=prompt)
    assert uncached["cached_prompt_tokens"] == 0
    printed = result.stdout.removesuffix("\n")
    assert_replies_near(
        path, prompt, first["text"], printed, again["text"], uncached["text"], kv=kv
    )
    assert len(cache_files(home)) == 1  # a loaded prefix is not written again


def test_a_prompt_that_shares_a_long_prefix_loads_that_part(runner, home, tiny_path):
    first, _ = run(runner, tiny_path, prompt=long_prompt())
    longer = long_prompt() + " and then" + long_prompt(1, sentences=8)
    reused, _ = run(runner, tiny_path, prompt=longer)
    alone, _ = run(runner, tiny_path, "--no-cache", prompt=longer)
    # Everything up to where the prompts part is reused (a token may merge across the seam, and
    # the first run's reply is kept too, which may begin as the longer prompt goes on).
    assert reused["cached_prompt_tokens"] >= first["prompt_tokens"] - 2
    assert reused["cached_prompt_tokens"] < reused["prompt_tokens"]
    assert_replies_near(tiny_path, longer, reused["text"], alone["text"])
    short, _ = run(runner, tiny_path, prompt="A short prompt is never cached.")
    assert short["cached_prompt_tokens"] == 0 and len(cache_files(home)) == 1


def test_a_foreign_cache_is_refused(runner, home, tiny32_path):
    first, _ = run(runner, tiny32_path, "--ctx", "1024", prompt=long_prompt())
    (written,) = cache_files(home)
    # Another context size holds the same bytes for a sequence: the state is loaded.
    larger, _ = run(runner, tiny32_path, "--ctx", "2048", prompt=long_prompt())
    assert larger["cached_prompt_tokens"] > 512 and larger["restored_prompt_tokens"] > 512
    assert_replies_near(tiny32_path, long_prompt(), larger["text"])
    # Other KV types are other bytes: not loaded.
    out, _ = run(runner, tiny32_path, "--ctx", "1024", "--kv-type", "q8_0", prompt=long_prompt())
    assert out["cached_prompt_tokens"] == 0
    assert_replies_near(tiny32_path, long_prompt(), out["text"], kv="q8_0")
    # The same file, claiming another llama.cpp build: not this run's cache, not used.
    for path in cache_files(home):
        if path != written:
            path.unlink()
    header = read_header(written)
    data = written.read_bytes()
    start = data.index(b'"llama": "') + len(b'"llama": "')
    end = data.index(b'"', start)
    written.write_bytes(data[:start] + b"x" * (end - start) + data[end:])
    out, _ = run(runner, tiny32_path, "--ctx", "1024", prompt=long_prompt())
    assert out["cached_prompt_tokens"] == 0
    assert out["text"] == first["text"]  # same path: both prefilled in full, alike
    # The run kept its own state under the same name, over the foreign one.
    assert read_header(written).key == header.key


@pytest.mark.parametrize("damage", ["truncate", "flip state", "flip header", "not a cache"])
def test_a_damaged_cache_gives_one_warning_and_a_normal_run(runner, home, tiny_path, damage):
    first, _ = run(runner, tiny_path, prompt=long_prompt())
    (path,) = cache_files(home)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip state":
        data[-100] ^= 0xFF
    elif damage == "flip header":  # a token id or a comma: bad JSON, or a header unlike its name
        data[data.index(b'"tokens": [') + 15] ^= 0x01
    else:
        data = bytearray(b"hello, I am a text file\n" * 10)
    path.write_bytes(bytes(data))
    out, stderr = run(runner, tiny_path, prompt=long_prompt())
    assert out["cached_prompt_tokens"] == 0
    assert out["text"] == first["text"]  # same path: both prefilled in full, alike
    warnings = [line for line in stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "prompt cache" in warnings[0] and "removed" in warnings[0]
    # The damaged file went; this run kept a good one in its place.
    out, stderr = run(runner, tiny_path, prompt=long_prompt())
    assert out["cached_prompt_tokens"] == first["prompt_tokens"] - EXACT_BATCH
    assert "warning" not in stderr


def test_cache_max_evicts_the_least_recently_used(runner, home, tiny_path):
    run(runner, tiny_path, prompt=long_prompt(0))
    (first,) = cache_files(home)
    size = first.stat().st_size
    limit = f"{int(size * 2.5)}"  # room for two files
    run(runner, tiny_path, "--cache-max", limit, prompt=long_prompt(1))
    run(runner, tiny_path, "--cache-max", limit, prompt=long_prompt(0))  # 0 is used again
    run(runner, tiny_path, "--cache-max", limit, prompt=long_prompt(2))  # 1 goes
    assert len(cache_files(home)) == 2
    zero, _ = run(runner, tiny_path, "--cache-max", limit, prompt=long_prompt(0))
    one, _ = run(runner, tiny_path, "--cache-max", limit, prompt=long_prompt(1))
    assert zero["cached_prompt_tokens"] > 0
    assert one["cached_prompt_tokens"] == 0
    # A limit smaller than one file keeps nothing new, and says nothing about it.
    result = runner.invoke(
        app, ["run", "-m", str(tiny_path), *GREEDY, "--cache-max", "1KiB", long_prompt(3)]
    )
    assert result.exit_code == 0 and "warning" not in result.stderr
    assert len(cache_files(home)) == 2
    assert sum(p.stat().st_size for p in cache_files(home)) <= int(limit)


def test_quill_cache_lists_and_clears(runner, home, tiny_path):
    empty = runner.invoke(app, ["cache"])
    assert empty.exit_code == 0 and "no prompt caches" in empty.stderr
    first, _ = run(runner, tiny_path, prompt=long_prompt())
    listed = runner.invoke(app, ["cache", "list"])
    assert listed.exit_code == 0
    (line,) = [row for row in listed.stdout.splitlines() if row.endswith(".kv") or ".kv " in row]
    assert f" {first['prompt_tokens'] + first['generation_tokens'] - 1} " in line
    assert "1 files" in listed.stdout
    cleared = runner.invoke(app, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 1 prompt caches" in cleared.stderr
    assert cache_files(home) == []
    wrong = runner.invoke(app, ["cache", "drop"])
    assert wrong.exit_code == 2 and "list or clear" in wrong.stderr


def test_a_bad_cache_max_is_a_usage_error(runner, home, tiny_path):
    result = runner.invoke(app, ["run", "-m", str(tiny_path), "--cache-max", "lots", "hi"])
    assert result.exit_code == 2 and "--cache-max" in result.stderr


def _small_files_only() -> None:
    # Writing past the limit fails with EFBIG instead of killing the process (SIGXFSZ ignored),
    # as a full disk fails a write with ENOSPC.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))  # the tiny state: ~170 KiB


def test_a_full_disk_while_saving_leaves_the_run_intact(home, tiny_path):
    command = [QUILL, "run", "-m", str(tiny_path), *GREEDY, long_prompt()]
    limited = subprocess.run(
        command, capture_output=True, text=True, env=quill_env(home), timeout=300,
        preexec_fn=_small_files_only,
    )  # fmt: skip
    assert limited.returncode == 0, limited.stderr
    assert "prompt cache not kept" in limited.stderr and limited.stdout.strip()
    assert cache_files(home) == []
    assert not [p for p in cache_dir(home).iterdir() if p.name.endswith(".part")]
    free = subprocess.run(command, capture_output=True, text=True, env=quill_env(home), timeout=300)
    assert free.returncode == 0
    assert free.stdout == limited.stdout  # same path: no cache was kept to load


def test_two_runs_at_once_share_the_cache_directory(home, tiny_path):
    command = [QUILL, "run", "-m", str(tiny_path), *GREEDY, long_prompt()]
    env = quill_env(home)
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                             text=True) for _ in range(3)]  # fmt: skip
    outputs = [process.communicate(timeout=300) for process in runs]
    assert all(process.returncode == 0 for process in runs)
    assert all("warning" not in stderr for _, stderr in outputs)
    assert len(cache_files(home)) == 1
    after = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert "tokens from cache" in after.stderr
    # Each run prefilled in full or loaded a cache another had written by then: either path.
    printed = [stdout.removesuffix("\n") for stdout in [*(o for o, _ in outputs), after.stdout]]
    assert_replies_near(tiny_path, long_prompt(), *printed)


def test_a_cache_directory_that_cannot_be_made_costs_only_the_cache(runner, home, tiny_path):
    (home / "cache").mkdir(parents=True)
    (home / "cache" / "prompts").write_text("a file where the directory should be\n")
    result = runner.invoke(app, ["run", "-m", str(tiny_path), *GREEDY, long_prompt()])
    assert result.exit_code == 0 and result.stdout.strip()
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "prompt cache not kept" in warnings[0]

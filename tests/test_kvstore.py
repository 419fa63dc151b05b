"""The KV store survives (issue 43): quill serve keeps its slots' sequences on disk before a model
leaves memory (evicted, stopped, the server ending), and a later request whose prompt extends one
loads it instead of prefilling, after a reload and after a restart; quill run and serve load what
the other kept. The reply is the one an uncached request gets (up to near-ties: the near-tie
comparator), a damaged or forged entry is one warning line and the request still answers, the
store stays within --cache-max, and quill cache clear empties it under a running server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx2 as httpx
import pytest

from cli.engine.loading import cpu_backend_features, repack_plan, tensor_infos
from cli.store.promptcache import (
    cache_dir,
    encode_header,
    entry_name,
    files,
    read_header,
    read_state,
)

from conftest import run_quill, start_server
from neartie import assert_near
from reference import Reference

SYSTEM = "You answer in short sentences about rivers, bridges and the towns beside them. " * 4
TURNS = ["Name a long river.", "Which towns lie on it?", "And which bridge is the oldest?"]


def models(tmp_path: Path, tiny_path: Path, tiny32_path: Path) -> tuple[Path, Path]:
    """Two models of different content (the store's key is the content's sha256)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shutil.copyfile(tiny_path, a)
    shutil.copyfile(tiny32_path, b)
    return a, b


def ask(url: str, model: str, messages: list[dict], **extra) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def two_turns(url: str, model: str) -> list[dict]:
    """The conversation's first two turns; the messages of its third."""
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in TURNS[:2]:
        messages.append({"role": "user", "content": turn})
        messages.append(ask(url, model, messages)["choices"][0]["message"])
    return [*messages, {"role": "user", "content": TURNS[2]}]


def stop(process: subprocess.Popen) -> str:
    """SIGTERM (the server drains and keeps its sequences); its log."""
    process.terminate()
    return process.communicate(timeout=60)[1]


def assert_as_uncached(path: Path, messages: list[dict], *texts: str) -> None:
    reference = Reference(path, n_ctx=1024, threads=1)
    try:
        turns = [(m["role"], m["content"]) for m in messages]
        prompt = reference.tokenize(reference.chat(turns), add_special=True)
        assert_near(reference, prompt, *texts)
    finally:
        reference.close()


def restored(reply: dict) -> int:
    timings = reply["timings"]
    assert timings["cache_n"] == timings["cache_memory_n"] + timings["cache_disk_n"]
    return timings["cache_disk_n"]


@pytest.mark.parametrize("model", ["tiny_path", "smollm2_path"])
def test_an_evicted_models_conversation_comes_back_from_disk(
    tmp_path, request, tiny_path, tiny32_path, model
):
    a, b = models(tmp_path, request.getfixturevalue(model), tiny32_path)
    home = tmp_path / "home"
    process, url = start_server(
        home, tmp_path, str(a), str(b), "--max-models", "1", "--ctx", "1024", "--parallel", "1"
    )
    try:
        third = two_turns(url, "a")
        ask(url, "b", [{"role": "user", "content": "Hello."}])  # a is evicted, its slot kept
        back = ask(url, "a", third)
        uncached = ask(url, "a", third, cache_prompt=False)
    finally:
        log = stop(process)
    assert f"kept 1 KV state of {a} in the KV store" in log.split("unloaded")[0]
    # Its weights were its file's pages (nothing repacked here): evicted, it stayed mapped.
    mapped = not repack_plan(tensor_infos(a), cpu_backend_features())
    assert (f"loaded {a} from its mapped weights in" in log) == mapped, log
    # The whole conversation so far came from disk: the third turn prefilled its new message.
    assert restored(back) == back["timings"]["cache_n"] > len(SYSTEM) // 8
    assert back["timings"]["prompt_n"] < uncached["timings"]["prompt_n"] // 3
    assert restored(uncached) == 0 and uncached["timings"]["cache_n"] == 0
    assert f"{restored(back)} from disk" in log
    texts = [reply["choices"][0]["message"]["content"] for reply in (back, uncached)]
    assert_as_uncached(a, third, *texts)


@pytest.mark.parametrize("model", ["tiny_path", "smollm2_path"])
def test_a_restarted_server_loads_the_conversation_it_kept(tmp_path, request, model):
    path = request.getfixturevalue(model)
    home = tmp_path / "home"
    process, url = start_server(home, tmp_path, str(path), "--ctx", "1024", "--parallel", "2")
    try:
        third = two_turns(url, path.stem)
    finally:
        log = stop(process)
    assert "kept 1 KV state of" in log and len(files(cache_dir(home))) == 1
    process, url = start_server(home, tmp_path, str(path), "--ctx", "2048", "--parallel", "1")
    try:
        back = ask(url, path.stem, third)
        uncached = ask(url, path.stem, third, cache_prompt=False)
    finally:
        stop(process)
    assert restored(back) > len(SYSTEM) // 8
    assert back["timings"]["prompt_n"] < uncached["timings"]["prompt_n"] // 3
    texts = [reply["choices"][0]["message"]["content"] for reply in (back, uncached)]
    assert_as_uncached(path, third, *texts)


def kept_conversation(home: Path, tmp_path: Path, path: Path) -> list[dict]:
    """A server that held two turns and ended: the third turn's messages."""
    process, url = start_server(home, tmp_path, str(path), "--ctx", "1024", "--parallel", "1")
    try:
        third = two_turns(url, path.stem)
    finally:
        stop(process)
    return third


def test_a_damaged_or_forged_entry_is_one_warning_and_the_request_answers(tmp_path, tiny_path):
    home = tmp_path / "home"
    third = kept_conversation(home, tmp_path, tiny_path)
    (entry,) = files(cache_dir(home))
    header = read_header(entry)
    state = read_state(header)
    # The state under a header that claims five tokens fewer than it holds: every check of the
    # store passes, the cells' positions do not.
    tokens = header.tokens[:-5]
    forged = (
        entry.with_name(entry_name(header.key, tokens)),
        encode_header(header.key, tokens, state) + state,
    )
    damaged = bytearray(entry.read_bytes())
    damaged[-50] ^= 0xFF
    for contents, why in (((entry, damaged),), "checksum"), ((forged,), "llama.cpp refused"):
        for path in files(cache_dir(home)):
            path.unlink()
        for path, data in contents:
            path.write_bytes(bytes(data))
        process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024")
        try:
            back = ask(url, tiny_path.stem, third)
        finally:
            log = stop(process)
        warnings = [line for line in log.splitlines() if "warning" in line]
        assert len(warnings) == 1 and why in warnings[0], log
        assert restored(back) == 0 and back["choices"][0]["message"]["content"]


def store_bytes(home: Path) -> int:
    return sum(path.stat().st_size for path in files(cache_dir(home)))


def test_the_store_stays_within_its_bound_and_clears_under_a_running_server(
    tmp_path, tiny_path, tiny32_path
):
    a, b = models(tmp_path, tiny_path, tiny32_path)
    home = tmp_path / "home"
    kept_conversation(home, tmp_path, a)
    one_state = store_bytes(home)
    bound = one_state * 5 // 2  # two conversations' states, not three
    process, url = start_server(
        home, tmp_path, str(a), str(b), "--max-models", "1", "--ctx", "1024", "--parallel", "1",
        "--cache-max", str(bound),
    )  # fmt: skip
    try:
        for n in range(4):  # each conversation evicted: a state kept, the oldest dropped
            system = {"role": "system", "content": f"Conversation {n}. {SYSTEM}"}
            ask(url, "a", [system, {"role": "user", "content": TURNS[0]}])
            ask(url, "b", [{"role": "user", "content": "Hello."}])
            assert 0 < store_bytes(home) <= bound
        cleared = run_quill(home, "cache", "clear")
        assert cleared.returncode == 0 and "removed" in cleared.stderr
        assert files(cache_dir(home)) == []
        ask(url, "a", [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}])
        ask(url, "b", [{"role": "user", "content": "Hello."}])
        assert len(files(cache_dir(home))) == 1  # the store goes on after it was emptied
    finally:
        stop(process)


def test_no_cache_keeps_nothing(tmp_path, tiny_path):
    home = tmp_path / "home"
    process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024", "--no-cache")
    try:
        two_turns(url, tiny_path.stem)
    finally:
        log = stop(process)
    assert "kept" not in log and files(cache_dir(home)) == []


def long_text(seed: int) -> str:
    """Some 600 tokens (past quill run's 512-token threshold), different for each seed."""
    return " ".join(
        f"Line {n + seed}: the ferry leaves the harbour at {n % 12} o'clock." for n in range(25)
    )


def test_run_and_serve_load_what_the_other_kept(tmp_path, tiny_path):
    home = tmp_path / "home"
    args = ["run", "--json", "--raw", "-m", str(tiny_path), "-n", "4", "--temperature", "0"]
    ran = run_quill(home, *args, "--ctx", "1024", long_text(0))
    assert ran.returncode == 0 and len(files(cache_dir(home))) == 1, ran.stderr
    process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024")
    try:

        def complete(prompt: str) -> dict:
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response.json()

        served = complete(long_text(0) + " And then")  # what run kept, and more
        assert restored(served) > served["usage"]["prompt_tokens"] * 0.8
        complete(long_text(1))  # a long prefill: kept at once, for other processes
    finally:
        stop(process)
    again = run_quill(home, *args, "--ctx", "2048", long_text(1) + " After that")
    assert again.returncode == 0, again.stderr
    out = json.loads(again.stdout)
    assert out["restored_prompt_tokens"] > out["prompt_tokens"] * 0.8


# --- llama-server's slot actions, on the same store ---------------------------------------------


def slot(url: str, index: int | str, action: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/slots/{index}?action={action}", json=body, timeout=120)


def test_slot_save_restore_and_erase_answer_as_llama_server_and_survive_a_restart(
    tmp_path, tiny_path
):
    home = tmp_path / "home"
    process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024", "--parallel", "1")
    try:
        third = two_turns(url, tiny_path.stem)
        saved = slot(url, 0, "save", filename="rivers.bin")
        assert saved.status_code == 200, saved.text
        answer = saved.json()
        assert answer["id_slot"] == 0 and answer["filename"] == "rivers.bin"
        assert answer["n_saved"] > len(SYSTEM) // 8 and answer["n_written"] > 0
        erased = slot(url, 0, "erase").json()
        assert erased == {"id_slot": 0, "n_erased": answer["n_saved"]}
    finally:
        stop(process)
    assert (cache_dir(home) / "slots" / "rivers.bin.json").is_file()
    process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024", "--parallel", "2")
    try:
        restored_slot = slot(url, 1, "restore", filename="rivers.bin")
        assert restored_slot.status_code == 200, restored_slot.text
        assert restored_slot.json()["n_restored"] == answer["n_saved"]
        back = ask(url, tiny_path.stem, third)
        # The conversation was in slot 1's memory: nothing came from disk for the request.
        assert back["timings"]["cache_memory_n"] > len(SYSTEM) // 8
        assert restored(back) == 0
        refusals = [
            (slot(url, 0, "restore", filename="never-saved"), 404, "no slot state"),
            (slot(url, 0, "save", filename="../outside"), 400, "'filename'"),
            (slot(url, 0, "save", filename=".hidden"), 400, "'filename'"),
            (slot(url, 0, "save"), 400, "'filename'"),
            (slot(url, 0, "defragment"), 400, "'action'"),
            (slot(url, 7, "erase"), 400, "no slot 7"),
            (slot(url, "x", "erase"), 400, "must be a number"),
            (slot(url, 0, "save", filename="empty"), 400, "no tokens"),
        ]
    finally:
        stop(process)
    for response, status, needle in refusals:
        assert response.status_code == status and needle in response.text, response.text
    cleared = run_quill(home, "cache", "clear")
    assert cleared.returncode == 0 and files(cache_dir(home)) == []
    assert list((cache_dir(home) / "slots").iterdir()) == []  # no name left pointing nowhere


def test_a_busy_slot_is_a_409_and_no_store_is_a_501(tmp_path, tiny_path):
    home = tmp_path / "home"
    process, url = start_server(
        home, tmp_path, str(tiny_path), "--ctx", "4096", "--parallel", "1", "--no-cache"
    )
    try:
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "once upon a time", "max_tokens": 3000, "ignore_eos": True,
                    "temperature": 0, "stream": True}  # fmt: skip
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                for _ in r.iter_lines():
                    started.set()

        streamer = threading.Thread(target=stream)
        streamer.start()
        assert started.wait(60)
        busy = slot(url, 0, "erase")
        no_store = slot(url, 0, "save", filename="kept")
        streamer.join(timeout=120)
    finally:
        stop(process)
    assert busy.status_code == 409 and "serving a request" in busy.text, busy.text
    assert no_store.status_code == 501 and "without one" in no_store.text, no_store.text


def test_a_chat_kept_locally_goes_on_through_a_server_that_loads_its_state(tmp_path, tiny_path):
    """quill chat keeps its conversation in the store; resumed through --endpoint, the server
    (same model, same KV types) loads it instead of prefilling the conversation."""
    home = tmp_path / "home"
    system = "You are a patient writer of short, plain prose. " * 12
    common = ["--temperature", "0", "-n", "16", "-s", system]
    first = run_quill(
        home, "chat", "-m", str(tiny_path), *common, "--transcript", str(home / "c.json"),
        input_text="Describe a lighthouse keeper's day.\n",
    )  # fmt: skip
    assert first.returncode == 0 and len(files(cache_dir(home))) == 1, first.stderr
    process, url = start_server(home, tmp_path, str(tiny_path), "--ctx", "1024")
    try:
        resumed = run_quill(
            home, "chat", "--endpoint", f"{url}/v1", "--resume", "c",
            "--temperature", "0", "-n", "16", input_text="Now describe the night.\n",
        )  # fmt: skip
    finally:
        log = stop(process)
    assert resumed.returncode == 0, resumed.stderr
    disk = [int(n) for n in re.findall(r"cached, (\d+) from disk\)", log)]
    assert disk and disk[0] > len(system) // 8, log
    assert f"{disk[0]} from disk" in resumed.stderr  # the chat's stats line, from the timings

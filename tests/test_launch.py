"""The console script's second start (cli/launch.py): quill serve runs with glibc's malloc asking
for transparent huge pages where the kernel gives them on request, so a context's KV cache and
buffers are faulted in 2 MiB at a time; a user's own setting of the tunable is left alone, and
every other command starts once."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from cli import launch
from tests.conftest import quill_env, start_server

SERVE = ["quill", "serve", "model.gguf"]


@pytest.fixture
def thp_on_request(tmp_path, monkeypatch):
    """A kernel whose huge pages are given on request, whatever this machine's setting."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(launch, "THP_SETTING", str(setting))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return setting


def glibc_with_tunable() -> bool:
    return sys.platform == "linux" and launch._glibc_has_tunable()


@pytest.mark.skipif(not glibc_with_tunable(), reason="needs Linux with glibc 2.35+")
def test_serve_starts_again_asking_for_huge_pages(thp_on_request, monkeypatch):
    assert launch.huge_pages_environment(SERVE)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    tunables = launch.huge_pages_environment(SERVE)["GLIBC_TUNABLES"]
    assert tunables == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"


def test_a_users_setting_other_commands_and_other_kernels_start_once(thp_on_request, monkeypatch):
    assert launch.huge_pages_environment(["quill", "run", "model.gguf", "hi"]) is None
    assert launch.huge_pages_environment(["quill"]) is None
    for kernel in ("[always] madvise never", "always madvise [never]"):
        thp_on_request.write_text(kernel)
        assert launch.huge_pages_environment(SERVE) is None
    thp_on_request.write_text("always [madvise] never")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.hugetlb=0")
    assert launch.huge_pages_environment(SERVE) is None


def huge_pages_kb(pid: int) -> int:
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+) kB", rollup).group(1))


@pytest.mark.skipif(
    not glibc_with_tunable() or not launch._kernel_gives_on_request(),
    reason="needs glibc 2.35+ and a kernel giving huge pages on request",
)
def test_a_served_models_context_is_in_huge_pages(quill_home, tmp_path, smollm2_path):
    process, url = start_server(
        quill_home, tmp_path, str(smollm2_path), "--ctx", "8192", "--threads", "1",
        GLIBC_TUNABLES="",
    )  # fmt: skip
    try:
        environ = Path(f"/proc/{process.pid}/environ").read_bytes().split(b"\0")
        assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ
        reply = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            timeout=120,
        )
        assert reply.status_code == 200
        # The 180 MiB KV cache of 8,192 tokens, at least partly in 2 MiB pages.
        assert huge_pages_kb(process.pid) >= 32 * 1024
    finally:
        process.terminate()
        process.wait(timeout=30)


def run_python(code: str, env: dict[str, str] | None = None) -> str:
    """code's stdout in a fresh interpreter: this one has imported llama_cpp whole already."""
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
        env=env,
    )  # fmt: skip
    return done.stdout


def test_the_console_script_loads_only_llama_cpps_bindings_until_more_is_used():
    said = run_python(
        "import sys\n"
        "from cli.launch import llama_bindings\n"
        "llama_bindings()\n"
        "import llama_cpp\n"
        "print(llama_cpp.__version__, callable(llama_cpp.llama_decode))\n"
        "print(sorted(name for name in sys.modules if name.startswith('llama_cpp')))\n"
        "from llama_cpp import Llama\n"  # the high-level API, on first use
        "print(Llama.__module__, 'llama_cpp.llama_chat_format' in sys.modules)\n"
    ).splitlines()
    version = importlib.metadata.version("llama-cpp-python")
    assert said[0] == f"{version} True"
    assert said[1] == "['llama_cpp', 'llama_cpp._ctypes_extensions', 'llama_cpp.llama_cpp']"
    assert said[2] == "llama_cpp.llama True"


def test_a_reply_through_the_console_script_needs_only_the_bindings(quill_home, smollm2_path):
    """quill run as a user's shell starts it: a model loaded, a token decoded and printed, and
    llama_cpp's high-level modules never imported."""
    said = run_python(
        "import sys\n"
        "from cli.launch import console\n"
        f"sys.argv = ['quill', 'run', {str(smollm2_path)!r}, 'Hi', '-n', '2', '--no-stats']\n"
        "try:\n"
        "    console()\n"
        "except SystemExit as end:\n"
        "    assert not end.code, end.code\n"
        "print()\n"
        "print(sorted(name for name in sys.modules if name.startswith('llama_cpp')))\n",
        env=quill_env(quill_home),
    ).splitlines()
    assert said[0].strip()  # the model's two tokens
    assert said[-1] == "['llama_cpp', 'llama_cpp._ctypes_extensions', 'llama_cpp.llama_cpp']"

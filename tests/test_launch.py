"""The console script's second start (cli/launch.py): quill serve runs with glibc's malloc asking
for transparent huge pages where the kernel gives them on request, so a context's KV cache and
buffers are faulted in 2 MiB at a time; a user's own setting of the tunable is left alone, and
every other command starts once."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx2 as httpx
import pytest

from cli import launch
from tests.conftest import start_server

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

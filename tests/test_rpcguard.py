"""The parts of `quill rpc-server`'s guard that need no server: the reader that bounds each
request's declared size however the bytes are split, and finding the slots through which
llama.cpp's RPC library calls accept and recv (tests/test_rpc.py runs the server itself)."""

from __future__ import annotations

import ctypes
import platform
import random
import sys
from pathlib import Path

import pytest

from cli.engine import elfhook
from cli.engine.rpcrelay import CAPS_SIZE, HEADER, HELLO, RequestReader

SET_TENSOR, GRAPH_COMPUTE = 6, 10


def feed_in_pieces(reader: RequestReader, stream: bytes, seed: int) -> tuple[int, str | None]:
    """stream fed as a socket might give it: pieces of random sizes; how much was taken
    before a refusal, and the refusal."""
    pieces = random.Random(seed)
    at = 0
    while at < len(stream):
        piece = stream[at : at + pieces.randint(1, 40)]
        refused = reader.feed(len(piece), lambda start, n, piece=piece: piece[start : start + n])
        at += len(piece)
        if refused:
            return at, refused
    return at, None


def requests(*sizes: int) -> bytes:
    hello = HEADER.pack(HELLO, CAPS_SIZE) + bytes(CAPS_SIZE)
    return hello + b"".join(HEADER.pack(SET_TENSOR, n) + b"x" * n for n in sizes)


@pytest.mark.parametrize("seed", range(5))
def test_payloads_within_the_bound_pass_however_the_bytes_are_split(seed):
    stream = requests(0, 1, 100, 9, 64)
    assert feed_in_pieces(RequestReader(max_payload=100), stream, seed) == (len(stream), None)


@pytest.mark.parametrize("seed", range(5))
def test_a_header_past_the_bound_is_refused_before_its_payload(seed):
    stream = requests(10, 20) + HEADER.pack(SET_TENSOR, 2**40) + b"y" * 50
    taken, refused = feed_in_pieces(RequestReader(max_payload=100), stream, seed)
    assert refused == "a 1.0 TiB message (command 6), more than the 100 B this server takes in one"
    header_end = len(requests(10, 20)) + HEADER.size
    assert header_end <= taken < header_end + 40  # refused in the piece that finished it


def test_an_unknown_command_is_refused():
    reader = RequestReader(max_payload=100)
    stream = HEADER.pack(200, 0)
    assert reader.feed(len(stream), lambda at, n: stream[at : at + n]) == "unknown command 200"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"),
    reason="quill replaces a library's imports on Linux (x86-64, AArch64) only",
)
def test_llama_cpps_rpc_library_calls_accept_and_recv_through_slots_quill_can_find():
    import llama_cpp

    library = next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-rpc.so*"))
    elf = library.read_bytes()
    for name in ("accept", "recv"):
        _, slots = elfhook._import_slots(elf, name, elfhook._SLOT_RELOCATIONS[platform.machine()])
        assert len(slots) >= 1, name
    _, none = elfhook._import_slots(elf, "no_such_function", (7, 6, 1026, 1025))
    assert none == []


def test_a_file_that_is_not_elf_cannot_be_hooked(tmp_path):
    with pytest.raises(elfhook.HookError, match="not a 64-bit little-endian ELF"):
        elfhook._import_slots(b"MZ\x90\x00" + bytes(100), "recv", (7, 6))
    with pytest.raises(elfhook.HookError):
        elfhook.replace_import(0, "recv", ctypes.CFUNCTYPE(ctypes.c_int)(lambda: 0))

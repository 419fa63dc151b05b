"""ggml's shared libraries as llama.cpp itself runs them, for the parts llama-cpp-python does
not bind (the CPU backend's buffer types, the RPC backend, the abort callback, the quantizer of
one row that replicas are made with). Importing it loads llama.cpp."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping
from pathlib import Path

import llama_cpp as llama
from llama_cpp._ctypes_extensions import load_shared_library

LIBS = Path(llama.__file__).parent / "lib"

# A C function's argument types and result type (None: void), as ctypes takes them.
Signature = tuple[list[type], type | None]


@functools.cache
def ggml_library(name: str) -> ctypes.CDLL:
    """lib{name} (ggml, ggml-base) as llama.cpp links it. A wheel holds each library under
    several names as separate copies (libggml.so, libggml.so.0, ...): libllama loads the one its
    soname names, and a copy opened by another name has globals of its own (a backend registry,
    an abort callback) that llama.cpp never reads. So the copy already mapped is opened again."""
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux; elsewhere the wheel's plain name, as llama-cpp-python opens it
        for line in maps.read_text().splitlines():
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith(str(LIBS)) and Path(path).name.startswith(f"lib{name}.so."):
                return ctypes.CDLL(path)
    return load_shared_library(name, LIBS)


def declare(lib: ctypes.CDLL, signatures: Mapping[str, Signature]) -> ctypes.CDLL:
    """lib, its functions given their (argument types, result type)."""
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib

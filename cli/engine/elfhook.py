"""A function that a loaded shared library imports, replaced for that library alone, in this
process alone: the library calls it through a slot of its global offset table, and the slot is
rewritten to point at a ctypes callback. How `quill rpc-server` sees llama.cpp's server accept
and read without standing between it and its clients (rpcrelay.py says why).

ELF libraries (Linux, x86-64 and AArch64) only; `HookError` says where that cannot be done, and
the caller chooses another way. Nothing here loads llama.cpp.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import struct
import sys
from pathlib import Path
from typing import Any

# (JUMP_SLOT, GLOB_DAT): a call through the PLT, and one through the GOT (-fno-plt)
_SLOT_RELOCATIONS = {"x86_64": (7, 6), "aarch64": (1026, 1025)}
_SHT_RELA, _PT_LOAD = 4, 1
_ELF_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_SECTION = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
_PROGRAM = struct.Struct("<IIQQQQQQ")  # Elf64_Phdr
_RELA = struct.Struct("<QQq")  # Elf64_Rela
_SYMBOL = struct.Struct("<IBBHQQ")  # Elf64_Sym


class HookError(Exception):
    """The function cannot be replaced here: another platform or file format, or no such import."""


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def replace_import(inside: int, name: str, replacement: Any) -> None:
    """From now on, the library holding the code at address `inside` calls `replacement` where
    it called the function `name` (from libc or elsewhere). The caller keeps `replacement`
    alive for as long as the library may call it."""
    machine = platform.machine()
    if not sys.platform.startswith("linux") or machine not in _SLOT_RELOCATIONS:
        raise HookError("replacing a library's imports needs Linux on x86-64 or AArch64")
    libc = ctypes.CDLL(None, use_errno=True)
    info = _DlInfo()
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(inside, ctypes.byref(info)) or not info.dli_fname:
        raise HookError(f"no loaded library holds address {inside:#x}")
    path = Path(info.dli_fname.decode())
    first_address, offsets = _import_slots(path.read_bytes(), name, _SLOT_RELOCATIONS[machine])
    if not offsets:
        raise HookError(f"{path.name} does not import {name}")
    base = (info.dli_fbase or 0) - first_address  # where the file's address 0 was loaded
    pointer = ctypes.cast(replacement, ctypes.c_void_p).value
    page = mmap.PAGESIZE
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for offset in offsets:
        slot = base + offset
        start = slot & ~(page - 1)
        # Read-only after relocation where the library was linked with RELRO.
        if libc.mprotect(start, page, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise HookError(f"cannot write {path.name}'s slot for {name}")
        ctypes.c_void_p.from_address(slot).value = pointer


def _import_slots(elf: bytes, name: str, kinds: tuple[int, int]) -> tuple[int, list[int]]:
    """The lowest address the file loads at, and the addresses (file's own) of the slots its
    relocations of those kinds fill with symbol `name`."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise HookError("not a 64-bit little-endian ELF file")
    header = _ELF_HEADER.unpack_from(elf)
    program_at, section_at = header[5], header[6]
    program_count, section_count = header[10], header[12]
    loads = [
        _PROGRAM.unpack_from(elf, program_at + i * _PROGRAM.size) for i in range(program_count)
    ]
    first_address = min((p[3] for p in loads if p[0] == _PT_LOAD), default=0)
    sections = [
        _SECTION.unpack_from(elf, section_at + i * _SECTION.size) for i in range(section_count)
    ]
    slots = []
    for _, kind, _, _, offset, size, link, _, _, entry in sections:
        if kind != _SHT_RELA or not entry:
            continue
        symbols, strings = sections[link], sections[sections[link][6]]
        for at in range(offset, offset + size, entry):
            where, info, _ = _RELA.unpack_from(elf, at)
            if info & 0xFFFFFFFF not in kinds:
                continue
            symbol = _SYMBOL.unpack_from(elf, symbols[4] + (info >> 32) * _SYMBOL.size)
            start = strings[4] + symbol[0]
            if elf[start : elf.index(b"\0", start)].decode() == name:
                slots.append(where)
    return first_address, slots

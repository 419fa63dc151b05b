"""The console script's first step, before anything else is imported: where the kernel gives
transparent huge pages only to memory that asks for them ("madvise", most distributions'
default), quill serve starts again with glibc's malloc asking for them (GLIBC_TUNABLES
glibc.malloc.hugetlb=1), then runs cli/app.py's main.

Why: every load gives the model a context, whose KV cache and compute buffers are hundreds of
MiB that llama.cpp allocates and clears at once. In 4 KiB pages the clear takes a page fault per
page: 0.15 s of a 1B-class model's context at 8,192 tokens on 2 cores, which is most of what
loading a model from quill serve's shelf costs (cli/engine/shelf.py). In 2 MiB pages it took
0.035 s there, and prefill and decode ran as fast as before (llama-bench pp512 with and
without, three rounds in each order). The second start costs one interpreter start (tens of
ms), paid by quill serve only: its loads are on a request's path, again and again, while a
one-shot command loads once and spends the time reading its weights (quill run measured the same
end to end with and without, and 20 MB larger with, its heap in huge pages).

A user who sets glibc.malloc.hugetlb in GLIBC_TUNABLES (0 turns this off) is left as set."""

from __future__ import annotations

import contextlib
import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_environment(argv: list[str]) -> dict[str, str] | None:
    """The environment to start again in, or None where that would change nothing: not Linux
    with glibc 2.35+ (the tunable's first release), the kernel's huge pages always or never
    given, the tunable already set, or a command other than serve."""
    if sys.platform != "linux" or argv[1:2] != ["serve"]:
        return None
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables or not _glibc_has_tunable() or not _kernel_gives_on_request():
        return None
    return {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, (tunables, f"{TUNABLE}=1")))}


def _kernel_gives_on_request() -> bool:
    """Whether the kernel gives transparent huge pages to memory that asks ("[madvise]"); a
    kernel or container without the setting gives none."""
    try:
        with open(THP_SETTING, encoding="ascii") as setting:
            return "[madvise]" in setting.read()
    except OSError:
        return False


def _glibc_has_tunable() -> bool:
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
        major, minor = (int(part) for part in version.split(".")[:2])
    except (ValueError, OSError):  # musl and others have no such string
        return False
    return name == "glibc" and (major, minor) >= (2, 35)


def console() -> None:
    environment = huge_pages_environment(sys.argv)
    if environment is not None:
        # Where it cannot start again, it runs as started: only its contexts open slower.
        with contextlib.suppress(OSError):
            os.execve(sys.executable, sys.orig_argv, environment)
    from cli.app import main

    main()

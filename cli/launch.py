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

A user who sets glibc.malloc.hugetlb in GLIBC_TUNABLES (0 turns this off) is left as set.

Then it imports llama-cpp-python's ctypes bindings without its high-level API (llama_bindings):
quill uses only the bindings, and the package's own start imports the rest (its Llama class, chat
formats, jinja2), 75 ms of the 0.35 s a one-text `quill embed` took here."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

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
    llama_bindings()
    from cli.app import main

    main()


def llama_bindings() -> None:
    """Make `import llama_cpp` give the package with only its ctypes bindings loaded (what its
    `from .llama_cpp import *` puts there, and __version__, read when asked); its first use of
    anything else (the high-level Llama class) runs the package's own start then. Nothing
    changes where llama_cpp is already imported, missing, or not laid out as this expects."""
    if "llama_cpp" in sys.modules:
        return
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    package = importlib.util.module_from_spec(spec)
    sys.modules["llama_cpp"] = package
    try:
        import llama_cpp.llama_cpp as bindings
    except Exception:  # any failure: the plain import meets it again, as before
        for name in [name for name in sys.modules if name.split(".")[0] == "llama_cpp"]:
            del sys.modules[name]
        return
    names = {name: value for name, value in vars(bindings).items() if not name.startswith("_")}
    package.__dict__.update(names, __getattr__=_whole_package(package, spec.loader))


def _whole_package(package: ModuleType, loader: Any) -> Any:
    def __getattr__(name: str) -> Any:
        if name == "__version__":  # the distribution's, as the package's start sets it
            import importlib.metadata  # 30 ms of imports: only when asked

            return importlib.metadata.version("llama-cpp-python")
        if name.startswith("__"):  # pickle, inspect and others probe dunders: not a use
            raise AttributeError(name)
        del package.__dict__["__getattr__"]
        loader.exec_module(package)  # the package's own start: the high-level modules
        return getattr(package, name)

    return __getattr__

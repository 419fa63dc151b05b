"""Route llama.cpp's log lines: silent by default, to stderr when verbose, problems always kept
(llama.cpp explains a failed load only in its log; the engine's error carries those lines)."""

from __future__ import annotations

import ctypes
import sys
from collections import deque
from collections.abc import Callable

import llama_cpp

# ggml_log_level: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5
_WARN, _ERROR, _CONT = 3, 4, 5


class LlamaLog:
    def __init__(self) -> None:
        self.verbose = False
        # Sees every line; how a command follows work that llama.cpp reports only in its log.
        self.listener: Callable[[str], None] | None = None
        self._problems: deque[str] = deque(maxlen=20)
        self._last_level = 0
        # Keep a reference: llama.cpp holds only the C pointer, and a collected callback crashes.
        self._callback = llama_cpp.llama_log_callback(self._on_log)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    def _on_log(self, level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        line = text.decode("utf-8", errors="replace")
        if level == _CONT:
            level = self._last_level
        self._last_level = level
        if self.verbose:
            sys.stderr.write(line)
            sys.stderr.flush()
        if self.listener is not None:
            self.listener(line)
        if level >= _WARN and line.strip():
            self._problems.append(line.strip())

    def drain(self) -> list[str]:
        """The warnings and errors logged since the last drain, oldest first."""
        lines = list(self._problems)
        self._problems.clear()
        return lines


_log: LlamaLog | None = None


def llama_log() -> LlamaLog:
    global _log
    if _log is None:
        _log = LlamaLog()
    return _log

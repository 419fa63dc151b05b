"""How many cores are free right now: the default thread count on a machine others share.

llama.cpp's threads meet at a barrier after every matrix multiplication, so one thread sharing
its core with another process holds back all the others (2 cores beside one busy process:
decode ran at 32 tokens/s with 2 threads, 54 with 1). So quill measures the CPU time other
processes used (system-wide minus its own) over a window that starts at import, so a model's
load is the window; one shorter than MIN_WINDOW_S is waited out, one older than MAX_WINDOW_S
started afresh. While a model decodes, ThreadJudge looks again (llama.cpp takes a new count
between decodes): a busy process started after the load is left out too.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import psutil

from cli.engine.hardware import physical_cores

MIN_WINDOW_S = 0.15  # psutil's CPU times tick every 10 ms: 15 ticks per core at least
MAX_WINDOW_S = 5.0
# A core counts as busy when other processes use more than this share of it: a thread of ours
# there would wait for its time slice at every barrier.
BUSY_SHARE = 0.3
LOOK_EVERY_S = 0.25  # a decoding engine's looks at the load (a psutil read, well under 1 ms)
CONFIRM_S = 1.0  # more threads once looks in a row covering this long agree on them


@dataclass(frozen=True)
class _Snapshot:
    wall: float
    busy_s: float  # all CPUs' non-idle seconds since boot
    own_s: float  # this process's CPU seconds, all threads


def _snapshot() -> _Snapshot:
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    busy = sum(times) - idle
    # guest time is already counted in user time on Linux.
    busy -= getattr(times, "guest", 0.0) + getattr(times, "guest_nice", 0.0)
    own = psutil.Process().cpu_times()
    return _Snapshot(time.monotonic(), busy, own.user + own.system)


_window_start = _snapshot()


@dataclass(frozen=True)
class CoreLoad:  # what the last measurement saw
    logical_cpus: int
    physical_cores: int
    busy_elsewhere: float  # cores' worth of CPU time other processes used in the window
    window_s: float

    @property
    def busy_cores(self) -> int:
        """Cores counted as taken by other work (more than BUSY_SHARE of a core each)."""
        return min(self.logical_cpus, math.floor(self.busy_elsewhere + 1 - BUSY_SHARE))

    @property
    def threads(self) -> int:
        """One thread per physical core that other work leaves free, at least one."""
        free = self.logical_cpus - self.busy_cores
        return max(1, min(self.physical_cores, free))


def measure_free_cores() -> CoreLoad:
    """Other processes' CPU use since the window started (waiting out a short window)."""
    global _window_start
    start = _window_start
    age = time.monotonic() - start.wall
    if age > MAX_WINDOW_S:
        start = _snapshot()
        age = 0.0
    if age < MIN_WINDOW_S:
        time.sleep(MIN_WINDOW_S - age)
    end = _snapshot()
    _window_start = end  # the next measurement in this process starts here
    return _load(start, end)


def _load(start: _Snapshot, end: _Snapshot) -> CoreLoad:
    wall = max(end.wall - start.wall, 1e-6)
    others = max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s))
    return CoreLoad(
        logical_cpus=psutil.cpu_count(logical=True) or 1,
        physical_cores=physical_cores(),
        busy_elsewhere=others / wall,
        window_s=wall,
    )


def restart_window() -> None:
    """Start the next measurement's window now (before a model load, say)."""
    global _window_start
    _window_start = _snapshot()


class ThreadJudge:
    """An automatic thread count, judged again from other processes' CPU use since the last look.
    Fewer threads at once (a thread beside a busy core slowed decode 4x here), more once looks in
    a row covering CONFIRM_S agree: a burst elsewhere costs a second of fewer threads at most."""

    def __init__(self, load: CoreLoad) -> None:
        self.load, self.threads = load, load.threads  # the last look's load; the count in use
        self._since = _snapshot()
        self._proposed, self._agreed_s = load.threads, 0.0

    def look(self) -> bool:
        """Whether the count changed; nothing is read before LOOK_EVERY_S since the last look."""
        if time.monotonic() - self._since.wall < LOOK_EVERY_S:
            return False
        end = _snapshot()
        self.load, self._since = _load(self._since, end), end
        proposed = self.load.threads
        agreed = self._agreed_s if proposed == self._proposed else 0.0
        self._proposed, self._agreed_s = proposed, agreed + self.load.window_s
        if proposed == self.threads or (proposed > self.threads and self._agreed_s < CONFIRM_S):
            return False
        self.threads = proposed
        return True

"""Progress on stderr: a rich bar on a terminal, a few plain lines otherwise. The download
classes are tqdm's, the interface huggingface-hub reports bytes through; the rich one is in
cli/ui/richbar.py, imported only on a terminal (rich's progress and tqdm's rich module took 20 ms
of every command's start)."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm import tqdm

from cli.ui import render
from cli.units import human_bytes


class PlainDownloadLines(tqdm):
    """One line at each tenth of the file (and at least every 30 s), nothing animated."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._next_tenth = 1
        self._last_line = time.monotonic()
        kwargs["file"] = _Discard()  # display() writes the lines; tqdm's own writes (a newline
        super().__init__(*args, **kwargs)  # at close) would leave blank lines in a log

    def display(self, msg: str | None = None, pos: int | None = None) -> None:
        total = self.total or 0
        done = total > 0 and self.n >= total
        tenth = int(10 * self.n / total) if total else 0
        if tenth < self._next_tenth and time.monotonic() - self._last_line <= 30:
            return
        size = human_bytes(self.n)
        if total:
            size = f"{100 * self.n / total:.0f}%, {size} of {human_bytes(total)}"
        rate = self.format_dict.get("rate") or 0
        speed = f", {human_bytes(rate)}/s" if rate else ""
        print(f"{self.desc or 'download'}: {size}{speed}", file=sys.stderr, flush=True)
        self._next_tenth = 11 if done else tenth + 1
        self._last_line = time.monotonic()


class _Discard:
    def write(self, _text: str) -> None: ...

    def flush(self) -> None: ...


def download_progress() -> type[tqdm]:
    if not sys.stderr.isatty():
        return PlainDownloadLines
    from cli.ui.richbar import RichDownloadBar

    return RichDownloadBar


class StepProgress:
    """Counted steps (tensors, windows) on stderr: a rich bar on a terminal, otherwise a plain
    line at each tenth. Use as a context manager; call update(done, total, detail), total 0 where
    it is not known (a count on a terminal, nothing otherwise)."""

    def __init__(self, description: str) -> None:
        self.description = description
        self._bar: Any = None
        self._task: Any = None
        self._next_tenth = 1

    def __enter__(self) -> StepProgress:
        if sys.stderr.isatty():
            from rich import progress as parts

            self._bar = parts.Progress(
                parts.TextColumn("{task.description}"),
                parts.BarColumn(),
                parts.MofNCompleteColumn(),
                parts.TimeElapsedColumn(),
                parts.TextColumn("{task.fields[detail]}"),
                console=render.stderr_console,
                transient=True,
            )
            self._bar.start()
        return self

    def update(self, done: int, total: int, detail: str = "") -> None:
        if self._bar is not None:
            known = total or None
            if self._task is None:
                self._task = self._bar.add_task(self.description, total=known, detail=detail)
            self._bar.update(self._task, completed=done, total=known, detail=detail)
            return
        if total and done * 10 >= self._next_tenth * total:
            print(f"{self.description}: {done}/{total} {detail}".rstrip(), file=sys.stderr)
            self._next_tenth = done * 10 // total + 1

    def __exit__(self, *_exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

"""Progress on stderr: a rich bar on a terminal, a few plain lines otherwise. The download
classes are tqdm's, the interface huggingface-hub reports bytes through."""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

from tqdm import TqdmExperimentalWarning, tqdm
from tqdm.rich import tqdm_rich

from cli.ui import render
from cli.units import human_bytes


class RichDownloadBar(tqdm_rich):
    """Bytes done and total, speed, time left."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("options", {"console": render.stderr_console})
        kwargs["unit_divisor"] = 1024  # the same MiB as every other size quill prints
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TqdmExperimentalWarning)
            super().__init__(*args, **kwargs)

    def display(self, *args: Any, **kwargs: Any) -> None:
        # tqdm's rich bar gives rich the total once, at the start; a download whose size is
        # learnt on the way (a package index's wheel) sets self.total later.
        # _prog and _task_id: tqdm_rich's own (set once its console is up), which its stubs omit.
        progress, task = getattr(self, "_prog", None), getattr(self, "_task_id", None)
        if progress is not None:
            progress.update(task, total=self.total)
        super().display(*args, **kwargs)


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
    return RichDownloadBar if sys.stderr.isatty() else PlainDownloadLines


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

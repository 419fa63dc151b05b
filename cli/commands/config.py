"""quill config: the user's defaults (cli/store/config.py), shown with where each comes from, set
and unset."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from cli.commands.options import JsonOutput
from cli.errors import UsageError

CONFIG_EPILOG = (
    "Settings: model (the model run, chat and serve use when none is named; QUILL_MODEL), "
    "endpoint (an OpenAI-compatible server run and chat send requests to; QUILL_ENDPOINT), "
    "stats (true or false: the stats line after run and chat; QUILL_STATS). An environment "
    "variable beats the file, and a flag beats both."
)


def config(
    action: Annotated[
        str, typer.Argument(help="show (the default), set KEY VALUE, or unset KEY.")
    ] = "show",
    key: Annotated[str | None, typer.Argument(help="model, endpoint or stats.")] = None,
    value: Annotated[str | None, typer.Argument(help="The value, for set.")] = None,
    json_output: JsonOutput = False,
) -> None:
    """Show the defaults in force and where each comes from, or set one in QUILL_HOME's
    config.toml."""
    from cli.store.config import SETTINGS, config_path, in_force, known, set_setting
    from cli.ui import render

    if action == "set" and key is not None and value is not None:
        known(key)
        set_setting(key, value)
        render.info_line(f"{key} = {json.dumps(in_force(key).value)} in {config_path()}")
        return
    if action == "unset" and key is not None and value is None:
        set_setting(key, None)
        render.info_line(f"{key} removed from {config_path()}")
        return
    if action != "show" or key is not None or value is not None:
        raise UsageError(
            f"quill config takes show, set KEY VALUE or unset KEY, not {action!r}"
            + (f" {key}" if key else "")
        )
    settings = [in_force(name) for name in SETTINGS]
    if json_output:
        data = {"config_file": str(config_path()), "settings": [s.as_dict() for s in settings]}
        render.write_stdout(json.dumps(data, indent=1) + "\n")
        return
    builtin = _builtin_defaults()
    rows = [
        [s.name, json.dumps(s.value) if s.source else builtin[s.name], s.source or "quill"]
        for s in settings
    ]
    render.write_stdout(render.columns(["SETTING", "VALUE", "FROM"], rows))


def _builtin_defaults() -> dict[str, str]:
    """What each setting is when nobody set it, as `quill config` shows it."""
    from cli.store.registry import load_registry

    return {
        "model": json.dumps(load_registry().default),
        "endpoint": "none (models run here)",
        "stats": "true",
    }

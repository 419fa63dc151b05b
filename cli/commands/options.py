"""What several commands share: option parsing, the model lookup, and the one way out on error."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from cli.errors import QuillError, UsageError

EXIT_CODES_HELP = (
    "Exit codes: 0 success (finish stop or length), 2 usage, 3 model not found or not obtainable, "
    "4 context overflow, 5 model failed to load, 130 interrupted."
)


# Options that several commands take, declared once so that they read the same everywhere.
Threads = Annotated[
    int | None, typer.Option("-t", "--threads", min=1, help="Default: physical cores.")
]
GpuLayers = Annotated[
    str | None,
    typer.Option("--gpu-layers", help="Layers to offload: N or all (default: all on a GPU)."),
]
# Sampling, as run and chat take it: the engine's own defaults, and ranges checked at parse time.
Temperature = Annotated[
    float, typer.Option("--temperature", "--temp", min=0.0, help="0 means greedy.")
]
TopK = Annotated[int, typer.Option("--top-k", min=0, help="0 turns it off.")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="1 turns it off.")]
MinP = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="0 turns it off.")]
RepeatPenalty = Annotated[float, typer.Option("--repeat-penalty", min=0.0, help="1 turns it off.")]
Seed = Annotated[
    int | None,
    typer.Option("--seed", min=0, help="Sampling seed. Default: a new random one each time."),
]
KvK = Annotated[str | None, typer.Option("--kv-k", help="KV type for K only.")]
KvV = Annotated[str | None, typer.Option("--kv-v", help="KV type for V only.")]
Offline = Annotated[bool, typer.Option("--offline", help="Use only models already on disk.")]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log.")]
ApiKey = Annotated[
    str | None,
    typer.Option("--api-key", envvar="QUILL_API_KEY", help="Bearer token for --endpoint."),
]


def parse_gpu_layers(value: str | None) -> int | None:
    if value is None:
        return None
    if value == "all":
        from cli.engine.engine import ALL_LAYERS

        return ALL_LAYERS
    if value.isdigit():
        return int(value)
    raise UsageError(f"--gpu-layers takes a number of layers or 'all', not {value!r}")


KV_TYPE_HELP = "KV-cache type for K and V: f16, q8_0 or q4_0 (also bf16, f32, q4_1, q5_0, q5_1)."
KvType = Annotated[str, typer.Option("--kv-type", help=KV_TYPE_HELP)]


def kv_types(kv_type: str, kv_k: str | None, kv_v: str | None) -> tuple[str, str]:
    from quant.kv import check_kv_types

    type_k, type_v = kv_k or kv_type, kv_v or kv_type
    try:
        check_kv_types(type_k, type_v)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return type_k, type_v


def obtain_model(name: str | None, offline: bool) -> tuple[str, Path]:
    """(label, local path) for a model name, downloading it if needed; None means the default."""
    from cli.store.models import obtain, parse_model_name
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.ui.progress import download_progress

    registry = load_registry()
    request = parse_model_name(name or registry.default, registry)
    path = obtain(
        request,
        offline=offline,
        report=render.info_line,
        progress=download_progress(),
        terminal=sys.stderr.isatty(),
    )
    return request.label, path


def fail(error: QuillError) -> NoReturn:
    from cli.ui.render import error_line

    error_line(str(error))
    raise typer.Exit(error.exit_code)

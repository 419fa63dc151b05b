"""quill quantize: smaller weights with llama.cpp's quantizer, kept in the store."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cli.commands.options import JsonOutput, Offline, check_threads

if TYPE_CHECKING:
    from cli.store.models import ModelRequest
    from cli.store.registry import Registry


def quantize(
    name: Annotated[str, typer.Argument(help="The model to quantize (F32/F16/BF16 GGUF).")],
    to: Annotated[
        str,
        typer.Option("--to", help="int8 (q8_0), int4 (q4_k_m), q4_0, q5_k_m, q6_k, ... or f16."),
    ],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Where to write it.")
    ] = None,
    threads: Annotated[
        int | None,
        typer.Option(
            "-t",
            "--threads",
            min=1,
            help="Default: every physical core, busy or not (quantize does not measure other "
            "work).",
        ),
    ] = None,
    allow_requantize: Annotated[
        bool,
        typer.Option(
            "--allow-requantize", help="Quantize an already-quantized model (loses quality)."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace the output if it exists.")
    ] = False,
    json_output: JsonOutput = False,
    offline: Offline = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show llama.cpp's log (one line per tensor).")
    ] = False,
) -> None:
    """Quantize a model's weights with llama.cpp's quantizer; --to f16 turns a quantized model back
    into F16 (it cannot restore the precision already lost)."""
    import json

    from cli.engine.hardware import physical_cores
    from cli.engine.llamalog import llama_log
    from cli.store.making import make_quantized, target_type
    from cli.store.registry import load_registry
    from cli.ui import render
    from cli.ui.progress import StepProgress
    from cli.units import human_bytes

    target = target_type(to)
    registry = load_registry()
    request, source = _source_model(name, target, registry, allow_requantize, offline)
    check_threads(threads)
    threads = threads or physical_cores()
    llama_log().verbose = verbose
    with StepProgress("tensors") as progress:
        made = make_quantized(
            name,
            request,
            source,
            target,
            registry,
            threads,
            output=output,
            allow_requantize=allow_requantize,
            force=force,
            on_tensor=None if verbose else progress.update,
            on_start=lambda: render.info_line(
                f"quantizing {source.name} to {target} with {threads} threads"
            ),
        )
    result, made_name = made.result, made.name
    if result.dequantized:
        render.warning_line(
            f"{name} is quantized: the {target} copy holds exactly its rounded weights, "
            "it cannot restore the precision they lost"
        )
    if json_output:
        render.write_stdout(json.dumps({"name": made_name, **result.as_dict()}, indent=1) + "\n")
    render.info_line(
        f"{made_name}: {human_bytes(result.output_bytes)} from {human_bytes(result.source_bytes)} "
        f"({result.ratio:.3f}), {result.bits_per_weight:.2f} bits per weight, "
        f"{result.seconds:.1f} s with {result.threads} threads -> {result.output}"
    )


def _source_model(
    name: str, target: str, registry: Registry, allow_requantize: bool, offline: bool
) -> tuple[ModelRequest, Path]:
    """(request, local file) of the model to quantize: NAME's own file, or, where NAME is an
    alias whose default file is quantized and the registry has a float file of it, that."""
    from cli.commands.options import obtain_request
    from cli.errors import ModelNotFoundError
    from cli.store.models import parse_model_name
    from cli.ui import render
    from quant.quantize import FLOAT_FILE_TYPES

    request = parse_model_name(name, registry)
    entry = registry.models.get(name)  # an alias with no tag: its default tag
    floats = FLOAT_FILE_TYPES.values()
    # The smallest float file first: f16, then bf16, then f32.
    float_tag = next((tag for tag in ("f16", "bf16", "f32") if entry and tag in entry.tags), None)
    if (
        entry is not None
        and float_tag
        and not allow_requantize
        and target not in floats
        and entry.default_tag not in floats
    ):
        # The default file is quantized: start from the registry's float file of the same
        # model, so that the weights are rounded once, as a user asking for NAME at int8 means.
        render.info_line(
            f"{name}'s default file is {entry.default_tag}; quantizing from {name}:{float_tag}"
        )
        request = parse_model_name(f"{name}:{float_tag}", registry)
        try:
            return request, obtain_request(request, offline)
        except ModelNotFoundError as error:
            raise ModelNotFoundError(
                f"{error}; or pass --allow-requantize to quantize the {entry.default_tag} file "
                "(its weights are then rounded twice)"
            ) from None
    return request, obtain_request(request, offline)

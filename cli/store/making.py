"""Making a quantized model and keeping it in the store beside its source (`alias:q8_0`), for
`quill quantize` and `quill quant-report`; renders nothing, raises QuillErrors."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cli.engine.llamalog import llama_log
from cli.errors import ModelLoadError, QuantizeRefusedError, SilentQuantizeError, UsageError
from cli.store.home import quill_home
from cli.store.models import Download, ModelRequest, file_quant, read_model, record
from cli.store.registry import Registry
from quant.quantize import (
    QuantizeError,
    QuantizeFailedError,
    QuantizeResult,
    quantize,
    tensor_progress,
    weight_type,
)

TensorProgress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Made:
    name: str  # how quill names the output, e.g. smollm2-135m:q8_0
    result: QuantizeResult


def target_type(name: str) -> str:
    """The llama.cpp weight type a name stands for (int8, int4, q4_k_m, ...), or a UsageError."""
    try:
        return weight_type(name)
    except QuantizeError as error:
        raise UsageError(str(error)) from None


def make_quantized(
    name: str,
    request: ModelRequest,
    source: Path,
    target: str,
    registry: Registry,
    threads: int,
    output: Path | None = None,
    allow_requantize: bool = False,
    force: bool = False,
    on_tensor: TensorProgress | None = None,
    on_start: Callable[[], None] | None = None,
    keep: bool = True,
) -> Made:
    """Quantize source to target; the output goes beside the source, or under QUILL_HOME/models
    for a model of the store, and is recorded there under alias:target (keep=False: neither,
    for a file of quill's own at output, such as quant-report's)."""
    read_model(source)  # not a GGUF, or truncated: one clear error before llama.cpp tries
    stem = re.sub(r"[-._](q\d\w*|f16|bf16|f32|iq\w+)$", "", source.stem, flags=re.IGNORECASE)
    base = name.partition(":")[0]
    alias = base if base in registry.models else re.sub(r"[^\w.-]", "_", stem)
    in_store = request.path is None or source.resolve().is_relative_to(quill_home().resolve())
    folder = quill_home() / "models" / alias / target if in_store else source.parent
    output = output or folder / f"{stem}-{target}.gguf"
    log = llama_log()
    log.drain()

    def follow(line: str) -> None:
        step = tensor_progress(line)
        if step is not None and on_tensor is not None:
            on_tensor(*step)

    log.listener = follow
    try:
        result = quantize(
            source, output, target, threads, allow_requantize, force, on_start=on_start
        )
    except QuantizeFailedError as error:
        reasons = "; ".join(log.drain()[-2:])
        if not reasons:
            raise SilentQuantizeError(str(error)) from None
        raise ModelLoadError(f"{error}: {reasons}") from None
    except QuantizeError as error:
        raise QuantizeRefusedError(error) from None
    finally:
        log.listener = None
    made_name = f"{alias}:{target}"
    if keep and (in_store or output.resolve().is_relative_to(quill_home().resolve())):
        what = (str(output), made_name, "quantize", None, output.name, result.output_bytes, None)
        record(quill_home(), Download(*what, time.time(), file_quant(output)))
    return Made(made_name, result)

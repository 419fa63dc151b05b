"""The one place where a GGUF becomes a llama.cpp model (tests/test_hardware.py checks that
nothing else calls llama_model_load_from_file), and the AMX guard every load passes; a file
llama.cpp refuses becomes a ModelLoadError with the reasons it logged (load_with_options).

llama.cpp's "extra" CPU weight buffers are CPU_REPACK (weights re-laid for wider SIMD kernels)
and, on Intel CPUs with AMX, an AMX buffer whose matmul crashes (llama.cpp issue 20824). Turning
them off also loses repacking (~1.4x on Q4_0), so on an AMX CPU quill turns them off and sends
the matrices the repack buffer can hold to CPU_REPACK by exact name. A tensor it cannot lay out
(a q6_K matrix on x86, an f32 norm) crashes the process, so the choice mirrors ggml's own rule
(ggml_repack_get_optimal_repack_type, ggml-cpu/repack.cpp) and takes only plain matmul weights.
"""

from __future__ import annotations

import ctypes
import functools
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as llama

from cli.engine.hardware import ANY_GPU, GGML_DEVICE_CPU, cpu_has_amx, gpu_memory
from cli.engine.llamalog import llama_log
from cli.engine.options import ALL_LAYERS, LoadOptions
from cli.engine.rpc import attach as rpc_devices
from cli.errors import ModelLoadError, SilentLoadError
from quant.ggmllib import Signature, declare, ggml_library
from quant.gguf import (
    GGML_TYPES,
    FileState,
    GGUFError,
    check_gguf_magic,
    file_state,
    read_header,
)

_LLAMA_ALL_LAYERS = 0x7FFFFFFF  # llama.cpp's n_gpu_layers for every layer
# ggml_type values (ggml.h) of the types the repack code knows.
Q4_0, Q8_0, Q2_K, Q4_K, Q5_K, Q6_K, IQ4_NL, MXFP4, Q1_0 = 2, 8, 10, 12, 13, 14, 20, 39, 41

# Weights that only ever feed a 2-D matmul with f32 activations, which is all the repack buffer
# runs (token_embd also feeds get_rows, and so does output.weight where it is tied to it).
MATMUL_WEIGHT = re.compile(
    r"blk\.(?P<layer>\d+)\.(?P<kind>attn_q|attn_k|attn_v|attn_output|attn_qkv|"
    r"ffn_gate|ffn_up|ffn_down)\.weight|output\.weight"
)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: int
    type_name: str
    n_dims: int
    rows: int  # ne[1] for a matrix: the count of output features


@functools.cache
def cpu_backend_features() -> dict[str, str]:
    """What llama.cpp's CPU backend was built with and found on this CPU (AVX2, NEON, ...): the
    very tests ggml's repack code makes."""
    llama.llama_backend_init()
    info = llama.llama_print_system_info().decode("utf-8", errors="replace")
    features: dict[str, str] = {}
    for item in info.split("|"):
        name, _, value = item.partition("=")
        name = name.split(":")[-1].strip()
        if name:
            features[name] = value.strip()
    return features


def repack_layout(ggml_type: int, rows: int, features: dict[str, str]) -> str | None:
    """The layout ggml would repack a matrix of this type and row count into, or None (always,
    off x86 and ARM: quill sends nothing it cannot prove safe)."""

    def has(name: str) -> bool:
        return features.get(name, "0") not in ("", "0")

    avx2, avx512 = has("AVX2"), has("AVX512")
    neon, i8mm, dotprod = has("NEON"), has("MATMUL_INT8"), has("DOTPROD")
    sve_256 = has("SVE") and i8mm and features.get("SVE_CNT") == "32"
    rules: list[tuple[bool, int, str]] = {
        Q4_0: [
            (avx2 or sve_256, 8, "q4_0_8x8"),
            (neon and i8mm, 4, "q4_0_4x8"),
            (neon and dotprod, 4, "q4_0_4x4"),
        ],
        Q4_K: [
            (avx2, 8, "q4_K_8x8"),
            (neon and i8mm, 8, "q4_K_8x8"),
            (neon and dotprod, 8, "q4_K_8x4"),
        ],
        Q2_K: [(avx512, 8, "q2_K_8x8")],
        Q5_K: [(neon and i8mm, 8, "q5_K_8x8"), (neon and dotprod, 8, "q5_K_8x4")],
        Q6_K: [(neon and i8mm, 8, "q6_K_8x8"), (neon and dotprod, 8, "q6_K_8x4")],
        IQ4_NL: [(avx2, 8, "iq4_nl_8x8"), (neon and dotprod, 4, "iq4_nl_4x4")],
        MXFP4: [(avx2, 8, "mxfp4_8x8"), (neon and dotprod, 4, "mxfp4_4x4")],
        Q8_0: [(neon and i8mm, 4, "q8_0_4x8"), (neon and dotprod, 4, "q8_0_4x4")],
        Q1_0: [(neon and i8mm, 4, "q1_0_4x8"), (neon and dotprod, 4, "q1_0_4x4")],
    }.get(ggml_type, [])
    for applies, divisor, layout in rules:
        if applies and rows % divisor == 0:
            return layout
    return None


@functools.cache
def _ggml_base() -> ctypes.CDLL:
    signatures: dict[str, Signature] = {
        "ggml_type_name": ([ctypes.c_int], ctypes.c_char_p),
        "ggml_backend_dev_backend_reg": ([ctypes.c_void_p], ctypes.c_void_p),
        "ggml_backend_reg_get_proc_address": ([ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p),
        "ggml_backend_buft_name": ([ctypes.c_void_p], ctypes.c_char_p),
    }
    return declare(ggml_library("ggml-base"), signatures)


def tensor_infos(path: Path) -> tuple[TensorInfo, ...]:
    """Each tensor's name, type and shape, from the GGUF header (none where it cannot be read);
    remembered for the file as it is: a load that places weights by type asks twice (the path
    table's choice, then the loader), 70 ms each on a 128k-token vocabulary, whose strings are
    walked to be skipped."""
    try:
        return _tensor_infos(file_state(path))
    except OSError:
        return ()


@functools.lru_cache(maxsize=64)
def _tensor_infos(state: FileState) -> tuple[TensorInfo, ...]:
    try:
        tensors = read_header(state[0]).tensors
    except GGUFError:
        return ()
    infos = []
    for tensor in tensors:
        # As ggml counts them: trailing dimensions of size 1 are none.
        n_dims = max((i + 1 for i, size in enumerate(tensor.shape) if size != 1), default=1)
        type_name = _ggml_base().ggml_type_name(tensor.type_id).decode()
        rows = tensor.shape[1] if n_dims == 2 else 0
        infos.append(TensorInfo(tensor.name, tensor.type_id, type_name, n_dims, rows))
    return tuple(infos)


def repack_plan(tensors: Sequence[TensorInfo], features: dict[str, str]) -> dict[str, str]:
    """{tensor name: repacked layout} for the matmul weights this CPU can repack."""
    plan = {}
    for tensor in tensors:
        if tensor.n_dims != 2 or not MATMUL_WEIGHT.fullmatch(tensor.name):
            continue
        layout = repack_layout(tensor.ggml_type, tensor.rows, features)
        if layout:
            plan[tensor.name] = layout
    return plan


def override_patterns(names: list[str]) -> list[str]:
    """Anchored patterns matching exactly these tensor names: one per kind of matrix (layers
    listed), since llama.cpp compiles every pattern again for every tensor it loads."""
    layers_by_kind: dict[str, list[str]] = defaultdict(list)
    patterns = []
    for name in names:
        match = MATMUL_WEIGHT.fullmatch(name)
        if match and match["layer"] is not None:
            layers_by_kind[match["kind"]].append(match["layer"])
        else:
            patterns.append(f"^{re.escape(name)}$")
    for kind, layers in layers_by_kind.items():
        patterns.append(rf"^blk\.({'|'.join(layers)})\.{kind}\.weight$")
    return patterns


@functools.cache
def _repack_buffer_type() -> int | None:
    """llama.cpp's CPU_REPACK buffer type, found among the CPU device's extra buffer types."""
    lib = _ggml_base()
    ggml = ggml_library("ggml")
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    device = ggml.ggml_backend_dev_by_type(GGML_DEVICE_CPU)
    if not device:
        return None
    registry = lib.ggml_backend_dev_backend_reg(device)
    address = lib.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)
    buffer_types = get_extra(device)
    i = 0
    while buffer_types and buffer_types[i]:
        if lib.ggml_backend_buft_name(buffer_types[i]) == b"CPU_REPACK":
            return buffer_types[i]
        i += 1
    return None


class _Override(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(frozen=True)
class CpuPath:
    """How the weights sit on the CPU: what `quill run --verbose` and `quill bench` name."""

    amx_avoided: bool  # llama.cpp's extra buffer types (AMX among them) are off
    repack: bool  # repacking was asked for
    repacked: dict[str, str] = field(default_factory=dict)  # tensor -> layout, sent by name
    kept_plain: tuple[str, ...] = ()  # repackable types kept plain (LoadOptions.plain_types)

    @property
    def label(self) -> str:  # a short name for tables
        return self._kind + "".join(f", {kind} plain" for kind in self.kept_plain)

    @property
    def _kind(self) -> str:
        if not self.repack:
            return "plain"
        if self.amx_avoided:
            return "amx-repack" if self.repacked else "amx-plain"
        return "by-name" if self.kept_plain else "extra"

    def describe(self) -> str:
        layouts = ", ".join(sorted(set(self.repacked.values())))
        said = {
            "plain": "repack off",
            "extra": "llama.cpp's extra buffers (repack where it can)",
            "amx-plain": "AMX avoided, nothing to repack",
            "amx-repack": f"AMX avoided, {len(self.repacked)} tensors repacked ({layouts})",
            "by-name": f"{len(self.repacked)} tensors repacked by name ({layouts or 'none'})",
        }[self._kind]
        if self.kept_plain:
            said += f"; {', '.join(self.kept_plain)} kept plain"
        return said


@dataclass
class LoadedModel:
    model: ctypes.c_void_p  # llama_model *, NULL when llama.cpp refused the file
    params: llama.llama_model_params
    cpu_path: CpuPath
    overrides: ctypes.Array | None = None  # kept alive with the parameters that point at it
    devices: ctypes.Array | None = None  # likewise


def amx_present() -> bool:
    """Whether this CPU (or llama.cpp's CPU backend) has AMX: load_model then avoids llama.cpp's
    extra buffer types, whose AMX path crashes."""
    return cpu_has_amx() or "AMX_INT8" in cpu_backend_features()


def load_model(
    path: Path,
    *,
    gpu_layers: int = 0,
    repack: bool = True,
    avoid_amx: bool | None = None,
    rpc: tuple[str, ...] = (),
    plain_types: frozenset[str] = frozenset(),
) -> LoadedModel:
    """Load the weights with the AMX guard. gpu_layers follows llama.cpp (0x7FFFFFFF = all);
    avoid_amx None reads the CPU, True forces the AMX path (safe on any CPU); rpc: the servers
    the offloaded layers go to (checked first, cli/engine/rpc.py); plain_types: weight types
    whose matrices stay as the file has them (cli/measure/paths.py's choice)."""
    llama.llama_backend_init()
    devices = rpc_devices(rpc)
    if avoid_amx is None:
        avoid_amx = amx_present()
    params = llama.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    plan: dict[str, str] = {}
    kept: dict[str, str] = {}  # tensor -> its type, kept plain though repackable
    # Offloaded layers belong on the GPU: name-based CPU overrides only when nothing is offloaded.
    if repack and gpu_layers == 0 and (avoid_amx or plain_types):
        tensors = tensor_infos(path)
        types = {tensor.name: GGML_TYPES[tensor.ggml_type][0] for tensor in tensors}
        plan = repack_plan(tensors, cpu_backend_features())
        kept = {name: types[name] for name in plan if types[name] in plain_types}
        plan = {name: layout for name, layout in plan.items() if name not in kept}
    # llama.cpp's extra buffers take every matrix they can (an override to the CPU buffer type
    # still lets them, llama_model::load_tensors): to keep some plain, they are turned off and
    # the others sent to CPU_REPACK by name, as on an AMX CPU.
    by_name = avoid_amx or bool(kept)
    params.use_extra_bufts = repack and not by_name
    overrides, plan = None, plan if by_name else {}
    if plan:
        repack_buffer = _repack_buffer_type()
        overrides = _overrides(list(plan), repack_buffer) if repack_buffer is not None else None
        plan = plan if overrides is not None else {}
    if overrides is not None:
        params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p)
    if devices is not None:
        params.devices = ctypes.cast(devices, ctypes.c_void_p)
    model = llama.llama_model_load_from_file(str(path).encode(), params)
    cpu_path = CpuPath(avoid_amx, repack, plan, tuple(sorted(set(kept.values()))))
    return LoadedModel(model, params, cpu_path, overrides, devices)


def _overrides(names: list[str], buffer_type: int) -> ctypes.Array:
    """llama.cpp's tensor_buft_overrides sending these tensors to buffer_type, NULL-ended."""
    patterns = override_patterns(names)
    overrides = (_Override * (len(patterns) + 1))()
    for slot, pattern in zip(overrides, patterns, strict=False):
        slot.pattern, slot.buft = pattern.encode(), buffer_type
    return overrides


def refuse_non_gguf(path: Path) -> None:
    """A file that is no GGUF is refused in one line before llama.cpp reads it."""
    try:
        check_gguf_magic(path)
    except GGUFError as error:
        raise ModelLoadError(str(error)) from None


def load_with_options(path: Path, options: LoadOptions) -> LoadedModel:
    """load_model as options say; a ModelLoadError with llama.cpp's logged reasons where it
    refuses the file."""
    gpu_layers = _LLAMA_ALL_LAYERS if options.gpu_layers == ALL_LAYERS else options.gpu_layers
    loaded = load_model(
        path,
        gpu_layers=gpu_layers,
        repack=options.repack,
        avoid_amx=options.avoid_amx,
        rpc=options.rpc,
        plain_types=options.plain_types,
    )
    if not loaded.model:
        raise load_failure(path, llama_log().drain())
    return loaded


def weights_are_the_file(path: Path, loaded: LoadedModel) -> bool:
    """Whether every weight is read from the file's mapped pages: loaded with mmap, no layer on a
    GPU or an RPC server, nothing repacked into a buffer of its own (llama.cpp's extra buffers
    repack what repack_plan finds). A build with a GPU backend counts as no: llama.cpp's
    automatic load mode maps the file only where every device it has can use the mapping."""
    params, cpu_path = loaded.params, loaded.cpu_path
    mapped = params.load_mode in (llama.LLAMA_LOAD_MODE_AUTO, llama.LLAMA_LOAD_MODE_MMAP)
    if not mapped or gpu_memory(ANY_GPU) or loaded.devices is not None:
        return False
    if cpu_path.repacked:
        return False
    if cpu_path.repack and not (cpu_path.amx_avoided or cpu_path.kept_plain):
        return not repack_plan(tensor_infos(path), cpu_backend_features())
    return True


def load_failure(path: Path, problems: list[str]) -> ModelLoadError:
    """The error of a model or context llama.cpp would not make, from its logged problems."""
    errors = [p for p in problems if "error" in p.lower() or "fail" in p.lower()] or problems
    if not errors:
        return SilentLoadError(f"llama.cpp cannot load {path}: llama.cpp gave no reason")
    return ModelLoadError(f"llama.cpp cannot load {path}: {'; '.join(errors[-2:])}")


def model_meta(model: Any, key: str) -> str | None:
    """A loaded model's metadata value of key, as text; None where it has none."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = llama.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1

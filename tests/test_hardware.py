"""Hardware detection, and the AMX guard: every load passes through cli/engine/loading.py, and its
AMX path (extra buffers off, repackable matrices sent to CPU_REPACK by name) is safe on any CPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli.engine.engine import Engine
from cli.engine.hardware import cpu_flags, cpu_has_amx, physical_cores
from cli.engine.loading import (
    MATMUL_WEIGHT,
    Q4_0,
    Q4_K,
    Q6_K,
    Q8_0,
    cpu_backend_features,
    override_patterns,
    repack_layout,
    repack_plan,
    tensor_infos,
)
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from quant.quantize import quantize

from reference import Reference
from tinymodel import write_tiny_llama

ROOT = Path(__file__).resolve().parent.parent
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 sha_ni vaes\n"
GREEDY = SamplingParams(temperature=0)
# Spelled in two parts, so that this test is not itself a file that names the call.
LOAD_CALL = "llama_model_" + "load_from_file"


def test_amx_is_read_from_cpuinfo(tmp_path):
    for text, expected in ((SAPPHIRE_RAPIDS, True), (EPYC, False)):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        assert cpu_has_amx(cpu_flags(path)) is expected
    assert cpu_flags(tmp_path / "missing") == set()


def test_physical_cores_is_positive():
    assert physical_cores() >= 1


def test_only_the_loader_loads_models():
    """One place loads every model (the engine, the reference decoder, benchmarks, scripts):
    a second caller would meet llama.cpp's AMX crash on Sapphire Rapids."""
    callers = []
    for folder in ("cli", "quant", "tests", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".sh") or ".build" in path.parts:
                continue  # benchmarks/.build: llama.cpp's own sources, built for comparison
            if LOAD_CALL in path.read_text(encoding="utf-8"):
                callers.append(str(path.relative_to(ROOT)))
    assert callers == ["cli/engine/loading.py"]


def test_repack_rule_follows_ggml():
    """Spot checks of ggml_repack_get_optimal_repack_type (vendor/llama.cpp, repack.cpp)."""
    avx2 = {"AVX2": "1"}
    arm = {"NEON": "1", "DOTPROD": "1"}
    assert repack_layout(Q4_0, 576, avx2) == "q4_0_8x8"
    assert repack_layout(Q4_0, 572, avx2) is None  # rows must split into groups of 8
    assert repack_layout(Q4_K, 1536, avx2) == "q4_K_8x8"
    assert repack_layout(Q6_K, 1536, avx2) is None  # the Q4_K_M case that crashed
    assert repack_layout(Q8_0, 576, avx2) is None
    assert repack_layout(Q4_0, 572, arm) == "q4_0_4x4"
    assert repack_layout(Q6_K, 1536, {**arm, "MATMUL_INT8": "1"}) == "q6_K_8x8"
    assert repack_layout(Q4_0, 576, {"RISCV_V": "1"}) is None  # unproven: left alone
    assert repack_layout(3, 576, avx2) is None  # q4_1 has no repacked layout


def test_override_patterns_match_exactly_the_chosen_tensors():
    names = [f"blk.{i}.{kind}.weight" for i in (0, 1, 12) for kind in ("attn_q", "ffn_up")]
    names.append("output.weight")
    patterns = [re.compile(p) for p in override_patterns(names)]
    others = [
        "blk.2.attn_q.weight",
        "blk.1.attn_q_norm.weight",
        "blk.12.ffn_up.weight.x",
        "blk.0.attn_norm.weight",
        "token_embd.weight",
        "output_norm.weight",
        "xblk.1.ffn_up.weight",
    ]
    for name in names:
        assert any(p.search(name) for p in patterns), name
    for name in others:
        assert not any(p.search(name) for p in patterns), name


@pytest.fixture(scope="module")
def q4_k_m_tiny(tmp_path_factory) -> Path:
    """A tiny model quantized by llama.cpp to Q4_K_M: mostly q4_K matrices, some q6_K, q8_0 or
    q5_0 ones, f32 norms. Sending any but the q4_K matrices to CPU_REPACK would crash."""
    folder = tmp_path_factory.mktemp("tiny-q4km")
    source = write_tiny_llama(folder / "f16.gguf", n_embd=256, n_ff=512, n_head=4)
    target = folder / "q4_k_m.gguf"
    quantize(source, target, "q4_k_m", threads=2)
    return target


def test_plan_takes_only_matmul_weights_of_repackable_types(q4_k_m_tiny):
    tensors = tensor_infos(q4_k_m_tiny)
    types = {t.type_name for t in tensors}
    assert {"q4_K", "f32"} <= types and len(types) >= 3, types
    features = cpu_backend_features()
    plan = repack_plan(tensors, features)
    by_name = {t.name: t for t in tensors}
    for name, layout in plan.items():
        tensor = by_name[name]
        assert MATMUL_WEIGHT.fullmatch(name) and tensor.n_dims == 2
        assert layout == repack_layout(tensor.ggml_type, tensor.rows, features)
    assert "token_embd.weight" not in plan
    assert not any("norm" in name for name in plan)
    x86_with_avx2 = features.get("AVX2") == "1" and "NEON" not in features
    if x86_with_avx2:
        assert {by_name[n].type_name for n in plan} == {"q4_K"}


@pytest.mark.parametrize("model", ["q4_k_m_tiny", "smollm2_path"])
def test_forced_amx_path_loads_and_generates(request, capsys, model):
    """The AMX branch, forced on whatever CPU runs the tests: extra buffer types off, the
    repackable matrices (if any) in CPU_REPACK, and generation working."""
    path = request.getfixturevalue(model)
    with Engine(path, LoadOptions(threads=2, avoid_amx=True), verbose=True) as engine:
        path_taken = engine.cpu_path
        events = list(engine.stream_generate(engine.tokenize("hello"), 4, GREEDY))
    assert events[-1].generation_tokens >= 1
    assert path_taken.amx_avoided and path_taken.repack
    log = capsys.readouterr().err
    assert not re.search(r"AMX\S* model buffer", log)  # llama.cpp never placed weights in AMX
    if path_taken.repacked:
        assert "CPU_REPACK" in log and path_taken.label == "amx-repack"
        assert f"{len(path_taken.repacked)} tensors repacked" in path_taken.describe()
    else:
        assert "CPU_REPACK" not in log and path_taken.label == "amx-plain"


def test_forced_amx_path_repacks_q4_0_on_cpus_that_can(smollm2_f16, tmp_path, capsys):
    """Q4_0 is the type worth repacking (1.4x prefill on an AVX-512 Xeon); on a CPU whose
    backend has a Q4_0 layout, the AMX path must actually repack it."""
    target = tmp_path / "q4_0.gguf"
    quantize(Path(smollm2_f16["output"]), target, "q4_0", threads=2)
    features = cpu_backend_features()
    expected = repack_layout(Q4_0, 576, features)
    with Engine(target, LoadOptions(threads=2, avoid_amx=True), verbose=True) as engine:
        path_taken = engine.cpu_path
        text = "".join(
            e.text for e in engine.stream_generate(engine.tokenize("The sea is"), 8, GREEDY)
        )
    assert text.strip()
    if expected is None:
        pytest.skip(f"this CPU backend has no repacked Q4_0 layout ({sorted(features)})")
    assert path_taken.label == "amx-repack"
    assert expected in set(path_taken.repacked.values())
    assert "repack tensor" in capsys.readouterr().err


def test_reference_decoder_loads_through_the_guard(smollm2_path):
    """The reference decoder with the AMX guard forced on: the loaded model's parameters say
    that llama.cpp was offered no extra buffer type (so no AMX), whatever this CPU is."""
    reference = Reference(smollm2_path, n_ctx=256, avoid_amx=True)
    try:
        params = reference.loaded.params
        assert params.use_extra_bufts is False
        assert params.n_gpu_layers == 0
        repacked = reference.loaded.cpu_path.repacked
        if repacked:  # only matrices of a repackable type are named
            assert params.tensor_buft_overrides
        else:
            assert not params.tensor_buft_overrides
        tokens = reference.greedy(reference.tokenize("Hello", add_special=True), 3)
        assert len(tokens) >= 1
    finally:
        reference.close()


def test_plain_load_turns_extra_buffers_off(tiny_path):
    with Engine(tiny_path, LoadOptions(threads=2, repack=False)) as engine:
        assert engine.cpu_path.label == "plain"
        assert engine.cpu_path.describe() == "repack off"
        assert list(engine.stream_generate(engine.tokenize("hi"), 2, GREEDY))


def test_default_path_depends_on_the_cpu(tiny_path):
    with Engine(tiny_path, LoadOptions(threads=2)) as engine:
        path_taken = engine.cpu_path
    amx = cpu_has_amx() or "AMX_INT8" in cpu_backend_features()
    assert path_taken.amx_avoided is amx
    if amx:
        assert path_taken.label == ("amx-repack" if path_taken.repacked else "amx-plain")
    else:
        assert path_taken.label == "extra"

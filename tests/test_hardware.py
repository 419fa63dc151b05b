"""Hardware detection, and the AMX guard taking effect inside llama.cpp."""

from __future__ import annotations

import pytest

from cli.engine import engine as engine_module
from cli.engine.engine import Engine, LoadOptions
from cli.engine.hardware import cpu_flags, cpu_has_amx, physical_cores
from cli.engine.sampling import SamplingParams

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse2 avx2 sha_ni vaes\n"


def test_amx_is_read_from_cpuinfo(tmp_path):
    for text, expected in ((SAPPHIRE_RAPIDS, True), (EPYC, False)):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        assert cpu_has_amx(cpu_flags(path)) is expected
    assert cpu_flags(tmp_path / "missing") == set()


def test_physical_cores_is_positive():
    assert physical_cores() >= 1


@pytest.mark.parametrize("amx", [True, False])
def test_amx_cpus_load_without_repacked_buffers(monkeypatch, capsys, tiny_path, amx):
    monkeypatch.setattr(engine_module, "cpu_has_amx", lambda: amx)
    with Engine(tiny_path, LoadOptions(threads=2), verbose=True) as engine:
        assert engine.repack is not amx
        tokens = engine.tokenize("hello")
        events = list(engine.stream_generate(tokens, 4, SamplingParams(temperature=0)))
    assert events[-1].generation_tokens >= 1
    log = capsys.readouterr().err
    # llama.cpp names the repack buffer type whenever it is offered one, and only then.
    assert ("CPU_REPACK" in log) is not amx

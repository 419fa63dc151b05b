"""Fuzz of the grammar path in the suite (issue 29): a short round of tests/grammar_fuzz.py
against the tiny model, in a real `quill serve` and real `quill run` processes, each under a
3 GiB memory limit. Generated grammars and schemas (bounds from 0 to 10^12, repetitions of
repetitions, classes that match nothing, deep nesting, long rule chains, recursive refs, forced
tool calls) may be answered or refused, never crash the process, stall it, or grow the server
past RSS_BOUND. `python -m benchmarks.fuzz_grammar` is the longer mode; on 1923c09 this round
killed the server within its first cases."""

from __future__ import annotations

import httpx2 as httpx

import grammar_fuzz
from conftest import quill_env

SERVER_SECONDS = 20  # the round's time on the server; a few more for quill run
CLI_SECONDS = 8


def test_generated_grammars_and_schemas_never_kill_serve_or_run(tiny_path, quill_home, tmp_path):
    env = quill_env(quill_home, OMP_WAIT_POLICY="passive")
    process, url = grammar_fuzz.start_server(tiny_path, env, tmp_path)
    try:
        report = grammar_fuzz.fuzz_server(url, process, 400, 29, SERVER_SECONDS)
        assert not report.failures, report.failures[:3]
        assert report.cases >= 20, report.cases  # enough of them ran to mean something
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert report.peak_rss < grammar_fuzz.RSS_BOUND
    finally:
        process.kill()
        process.wait()
    cli = grammar_fuzz.fuzz_cli(tiny_path, env, 40, 29, CLI_SECONDS)
    assert not cli.failures, cli.failures[:3]
    assert cli.cases >= 3

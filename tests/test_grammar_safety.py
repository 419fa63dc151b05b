"""Grammars that cannot hurt (issue 29): every grammar quill hands llama.cpp is read by quill
first (cli/engine/gbnf.py), over-budget or unmatchable ones are refused with one line, large
bounded repetitions are counted in a few rules, and one request can no longer end `quill serve`.

The reproductions run against the real tiny model in real processes under a memory limit (on
1923c09 they died with SIGSEGV or SIGABRT, or grew to the limit); the server must answer a
normal request after each."""

from __future__ import annotations

import json
import re
import resource
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # as tests/test_serve.py
import pytest

from cli.engine import gbnf
from cli.engine.gbnf import GrammarError, safe_grammar

from conftest import quill_env, run_quill

MEMORY_LIMIT = 3 << 30  # address space a quill process under test may have
EMPTY_SET = "root ::= [^\\x00-\\U0010FFFF]"
HUGE_SCHEMAS = [
    {"type": "string", "maxLength": 30000},
    {"type": "string", "pattern": "^a{0,100000}$"},
    {"type": "string", "maxLength": 1000000000},
    {"type": "string", "minLength": 1000000000},
]


def limited() -> None:
    """preexec_fn: the child may not grow past MEMORY_LIMIT (1923c09 grew to 14.7 GB)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_limited(quill_home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`quill ARGS` within MEMORY_LIMIT, its OpenMP threads not spinning."""
    env = quill_env(quill_home, OMP_WAIT_POLICY="passive")
    return run_quill(quill_home, *args, env=env, timeout=timeout, preexec_fn=limited)


# --- the checker, without a model ------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar, reason",
    [
        (EMPTY_SET, "can match nothing"),
        ('root ::= "a" root', "can match nothing"),
        ('root ::= "a" | "b" loop\nloop ::= "c" loop', "'loop' can never be completed"),
        ('root ::= "a"{5,2}', "maximum below its minimum"),
        ("root ::= " + "(" * 500 + '"a"' + ")" * 500, "nests groups deeper"),
        ('root ::= "' + "a" * 20000 + '"{60}', "elements"),
        ("root ::= x\n", "never defined"),
        ('x ::= "a"', "no 'root"),
        ('root ::= "a"' + "?" * 20, "repeats a repetition"),
        ("root ::= " + "x" * (gbnf.MAX_GRAMMAR_CHARS + 1), "characters"),
        ('root ::= "\\q"', "unknown escape"),
        ('root ::= ("a"?){5000}', "at most 2000"),
    ],
)
def test_refused_grammars_say_why(grammar, reason):
    with pytest.raises(GrammarError, match=re.escape(reason)):
        safe_grammar(grammar)


def test_large_bounds_are_a_few_rules_and_small_ones_stay_native():
    small = safe_grammar('root ::= [a-z]{3,5} "x"')
    assert small == 'root ::= [a-z]{3,5} "x"'
    for bound in (65, 1000, 100000, 10**9, 10**18):
        written = safe_grammar(f'root ::= "a"{{0,{bound}}}')
        rules = written.splitlines()
        assert len(rules) <= 4 * bound.bit_length() + 2, (bound, len(rules))
        assert not re.search(r"\{\d{3,}", written)  # no repetition llama.cpp would expand


# --- the CLI ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schema", HUGE_SCHEMAS, ids=["maxLength", "pattern", "max1e9", "min1e9"])
def test_run_with_a_huge_bound_stays_small_and_alive(tiny_path, quill_home, schema):
    started = time.monotonic()
    done = run_limited(
        quill_home, "run", "-m", str(tiny_path), "--schema", json.dumps(schema),
        "--max-tokens", "16", "--seed", "1", "--no-stats", "Say",
    )  # fmt: skip
    # 0: the reply holds; 7: cut by --max-tokens (minLength 10^9 cannot be met). Never a signal.
    assert done.returncode in (0, 7), (done.returncode, done.stderr[-2000:])
    assert time.monotonic() - started < 60
    assert done.stdout.startswith('"'), done.stdout[:200]
    assert "Traceback" not in done.stderr


def test_run_with_a_grammar_that_matches_nothing_is_exit_2_and_stdout_stays_empty(
    tiny_path, quill_home, tmp_path
):
    grammar = tmp_path / "empty.gbnf"
    grammar.write_text(EMPTY_SET + "\n")
    done = run_limited(quill_home, "run", "-m", str(tiny_path), "--grammar", str(grammar), "Say")
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-500:])
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "can match nothing" in lines[0], done.stderr


# --- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_server(tiny_path, quill_home, tmp_path_factory) -> Iterator[tuple]:
    from conftest import start_server

    process, url = start_server(
        quill_home, tmp_path_factory.mktemp("grammar-serve"),
        "-m", str(tiny_path), "--parallel", "2", "--ctx", "512", "--threads", "1",
        stdout=subprocess.PIPE, preexec_fn=limited, OMP_WAIT_POLICY="passive",
    )  # fmt: skip
    yield process, url
    process.kill()
    stdout, _ = process.communicate(timeout=30)
    assert stdout == ""  # nothing but replies, and those go to the socket


def chat(url: str, timeout: float = 60, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Say"}], "max_tokens": 8, "seed": 1}
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=timeout)


def assert_still_serving(process: subprocess.Popen, url: str) -> None:
    assert process.poll() is None, f"the server died: {process.returncode}"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    normal = chat(url)
    assert normal.status_code == 200, normal.text
    assert normal.json()["choices"][0]["message"]["content"] is not None


TOOL = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "maxLength": 30000}},
            "required": ["text"],
        },
    },
}


@pytest.mark.parametrize(
    "extra",
    [
        *({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}}
          for s in HUGE_SCHEMAS),
        {"tools": [TOOL], "tool_choice": "required"},
        {"grammar": EMPTY_SET},
        {"grammar": 'root ::= "a"{5,2}'},
        {"grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000},
    ],
    ids=["maxLength", "pattern", "max1e9", "min1e9", "tool", "empty-set", "wrapped-bound",
         "nested"],
)  # fmt: skip
def test_one_request_cannot_end_the_server(limited_server, extra):
    process, url = limited_server
    response = chat(url, **extra)
    assert response.status_code in (200, 400), (response.status_code, response.text[:500])
    if response.status_code == 400:
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert "\n" not in error["message"]
    assert_still_serving(process, url)


def test_a_dead_end_ends_the_reply_not_the_process(tiny_path, quill_home, tmp_path):
    """A grammar that needs a token no vocabulary writes (<[id]> past the vocabulary):
    llama.cpp would abort on the next accept; quill ends the reply with exit 7."""
    grammar = tmp_path / "dead.gbnf"
    grammar.write_text('root ::= "a" <[4000000000]>\n')
    done = run_limited(
        quill_home, "run", "-m", str(tiny_path), "--grammar", str(grammar), "--no-stats", "Say"
    )
    assert done.returncode == 7, (done.returncode, done.stderr[-1000:])
    assert done.stdout.strip() == "a"
    assert "no token of the model can continue" in done.stderr


def test_the_server_builds_each_grammar_in_a_trial_child_first(limited_server):
    process, url = limited_server
    children_before = _children(process.pid)
    response = chat(url, grammar='root ::= "yes" | "no"')
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")
    assert _children(process.pid) == children_before  # the trial child was reaped


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()

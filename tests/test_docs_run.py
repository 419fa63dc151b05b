"""Every plain `$ quill ...` example in the docs, run verbatim, in the order the page shows them,
in a quill home of the page's own that starts with only the default model (and the models its
EXTRA_MODELS entry names). On PIPELINE_PAGES the pipelines with quill in them run too.

An example whose output shows `quill: error:` must fail (with the exit code the page shows after
it, if it shows one); any other must succeed. Examples that take minutes (bench grids,
quant-report) carry the `docs_long` mark and run with `pytest -m docs_long`; examples that need
the network or a running server say so and are skipped.

Every exit status is checked strictly, on any CPU. That holds only because no example's outcome
hangs on a near-tie (the path greedy or seeded text takes differs between CPUs): an example that
must succeed at a form (a schema, JSON, a grammar) leaves the reply room to finish on any path
(test_structured_examples_leave_room), and one that shows a cut reply cuts it long before any path
could finish. The text of greedy and seeded examples is checked by tests/test_docs.py through the
near-tie comparator.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from test_docs import COMMANDS, ROOT

from conftest import QUILL, quill_env

LONG = {"bench", "quant-report"}
SKIP = {
    "gemma3-270m": "downloads Gemma 3 270M (240 MB) from the package index",
    "llama3.2-1b:q2_k": "needs the Hugging Face Hub",
    "someone/Tiny-GGUF": "needs a Hub (tests/test_pull_fit.py runs these against a stand-in)",
    "someone/Llama-3-70B-Instruct-GGUF:Q4_K_M": "needs a Hub (as above)",
    "--endpoint": "needs quill serve running on port 8080 (tests/test_serve.py covers it)",
    "--rpc": "needs quill rpc-server on the ports it names (tests/test_rpc.py covers it)",
    "rpc-server": "serves until stopped (tests/test_rpc.py starts and stops it)",
}
# Pages whose plain examples use what a pipeline before them made (embeddings.md: `quill embed
# --into notes < notes.txt` fills the collection `quill similar notes` searches): all their
# examples with quill in them run, pipelines too, in page order, as scripts/refresh_docs.py runs
# them.
PIPELINE_PAGES = {"embeddings.md"}
# Models a page needs beside the default one: the session fixture that pulls each (as
# scripts/refresh_docs.py's EXTRA_MODELS copies them from the user's own quill home).
EXTRA_MODELS = {"embeddings.md": ("minilm_path",)}
REPLICA_PATH = "/cache/replicas/"  # the replica a bench --replica example builds in the long pass
PAGES = sorted({doc for doc, *_ in COMMANDS})


def examples(page: str) -> list[tuple[int, list[str], str]]:
    """The page's plain examples (on PIPELINE_PAGES, all its examples) in order, its `rm`
    examples last (a page shows deleting a model as an example, not as a step before the
    examples that follow it)."""
    chosen = [(line, argv, shown) for doc, line, argv, shown, plain in COMMANDS
              if doc == page and (plain or page in PIPELINE_PAGES) and argv]  # fmt: skip
    return sorted(chosen, key=lambda example: example[1][0] == "rm")


def expected_exit(shown: str, page: str | None = None, line: int = 0) -> int | None:
    """0 for success; the code a `$ echo $?` right after the command's output on the page shows
    (page and line: the command's), or one inside the output; None: any failure."""
    if "quill: error:" not in shown:
        return 0
    if page is not None:
        after = _after_output(page, line)
        if after[:1] == ["$ echo $?"] and len(after) > 1 and after[1].strip().isdigit():
            return int(after[1])
    match = re.search(r"^\$ echo \$\?\n(\d+)", shown, re.MULTILINE)
    return int(match[1]) if match else None


def _after_output(page: str, line: int) -> list[str]:
    """The page's lines after the output of the command on line (1-based)."""
    raw = (ROOT / "docs" / page if page != "README.md" else ROOT / page).read_text().splitlines()
    end = line
    while end < len(raw) and not raw[end].startswith(("$ ", "```")):
        end += 1
    return raw[end : end + 2]


@pytest.fixture
def page_home(request, tmp_path_factory, smollm2_path, quill_home) -> Path:
    """A quill home of each page's own, holding only the default model, as after the README's
    first run, and the models the page's EXTRA_MODELS entry names, each with its manifest
    entry."""
    home = tmp_path_factory.mktemp("docs-home")
    callspec = getattr(request.node, "callspec", None)
    page = callspec.params.get("page") if callspec is not None else None
    models = [smollm2_path, *(request.getfixturevalue(f) for f in EXTRA_MODELS.get(page, ()))]
    for model in models:
        relative = model.relative_to(quill_home)
        (home / relative).parent.mkdir(parents=True)
        shutil.copy(model, home / relative)
    manifest = json.loads((quill_home / "manifest.json").read_text())
    entries = [
        {**entry, "path": entry["path"].replace(str(quill_home), str(home))}
        for entry in manifest["downloads"]
        if Path(entry["path"]) in models
    ]
    (home / "manifest.json").write_text(json.dumps({"downloads": entries}, indent=1))
    return home


def prepare_page(page: str, workdir: Path, home: Path) -> list[str]:
    """The page's lines, with the files its examples use made in workdir as
    scripts/refresh_docs.py makes them when it pastes the page's output: its FIXTURES, and the
    files the page shows with `$ cat FILE`."""
    from scripts.refresh_docs import make_fixtures, make_page_files

    make_page_files(page, workdir, home)
    raw = (ROOT / "docs" / page if page != "README.md" else ROOT / page).read_text().splitlines()
    for index in range(len(raw)):
        make_fixtures(raw, workdir, index, {})
    return raw


def run_page(page: str, home: Path, long: bool, workdir: Path) -> list[str]:
    raw = prepare_page(page, workdir, home)
    problems = []
    for line, argv, shown in examples(page):
        typed = raw[line - 1][2:]
        if "--help" in argv or "-h" in argv or REPLICA_PATH in typed:
            continue  # tests/test_replica_cli.py runs a replica
        reason = next((why for key, why in SKIP.items() if key in argv), None)
        if reason or (argv[0] in LONG) != long:
            continue
        if argv[0] == "serve" or (argv[0] == "chat" and "--endpoint" in argv):
            continue  # a server runs until stopped: tests/test_serve.py starts and stops one
        # Through bash as the user types it, so that $(...) and quoting behave the same.
        env = quill_env(home, PATH=f"{Path(QUILL).parent}:{os.environ['PATH']}")
        result = subprocess.run(
            ["bash", "-c", typed], env=env, cwd=workdir, capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=900,
        )  # fmt: skip
        want = expected_exit(shown, page, line)
        ok = result.returncode == want if want is not None else result.returncode not in (0, 1)
        if not ok or "Traceback" in result.stderr:
            problems.append(
                f"{page}:{line} quill {' '.join(argv)} exited {result.returncode} "
                f"(the page shows {want}): {result.stderr.strip()[-300:]}"
            )
    return problems


# A translation whose examples are its original's, in the same order, with the same files and
# the same expected exits, is run once, as its original (test_a_translation_runs_its_originals
# holds them equal; tests/test_docs_agree.py holds their outputs equal).
TRANSLATIONS = {"guide.zh.md": "guide.md"}


@pytest.mark.parametrize("page", [page for page in PAGES if page not in TRANSLATIONS])
def test_documented_examples_run(page, page_home, tmp_path):
    assert run_page(page, page_home, False, tmp_path) == []


def page_inputs(page: str, workdir: Path, home: Path) -> tuple[list, dict[str, str]]:
    """What running a page's examples depends on: each example's typed line and expected exit,
    in order, and the files the page makes for them."""
    workdir.mkdir()
    raw = prepare_page(page, workdir, home)
    typed = [
        (raw[line - 1][2:], expected_exit(shown, page, line)) for line, _, shown in examples(page)
    ]
    made = {
        str(path.relative_to(workdir)): path.read_text()
        for path in sorted(workdir.rglob("*"))
        if path.is_file() and path.relative_to(workdir).parts[0] != "tests"
    }
    return typed, made


def test_a_translation_runs_its_originals_examples(tmp_path):
    for translation, original in TRANSLATIONS.items():
        inputs = page_inputs(translation, tmp_path / translation, tmp_path / "home")
        assert inputs == page_inputs(original, tmp_path / original, tmp_path / "home")
        assert inputs[0], f"{translation} shows no examples"


@pytest.mark.docs_long
@pytest.mark.parametrize("page", PAGES)
def test_long_documented_examples_run(page, page_home, tmp_path):
    assert run_page(page, page_home, True, tmp_path) == []


ROOM = 256  # tokens: a structured reply's room to finish, whichever path sampling takes


def test_structured_examples_leave_room():
    """A documented run held to a form that the page shows succeeding must not hang on -n: on
    another CPU the same seed may take a longer path (speculative.md's example did, exit 7)."""
    tight = []
    for doc, line, argv, shown, plain in COMMANDS:
        form = {"--schema", "--format", "--grammar"} & set(argv)
        if not (plain and argv[:1] == ["run"] and form) or expected_exit(shown) != 0:
            continue
        for flag in ("-n", "--max-tokens"):
            if flag in argv and int(argv[argv.index(flag) + 1]) < ROOM:
                tight.append(f"{doc}:{line}")
    assert tight == []

"""quill embed and quill rerank through the CLI, on the real all-MiniLM-L6-v2 (converted from its
wheel on the package index): vectors as llama.cpp computes them, every input form and option,
and the inputs that must fail in one line."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import QUILL, quill_env, run_quill

TEXTS = [
    "The cat sat on the mat.",
    "A feline rested on the rug.",
    "Quarterly revenue rose by four percent.",
    "How do I reset my password?",
    "Steps to change your account password",
    "El gato duerme en la alfombra.",
    "Photosynthesis turns light into chemical energy.",
    "naïve café — ünïcödé 漢字 😀",
]


def embed(quill_home: Path, model: Path, *args: str, lines: list[str] | None = None):
    stdin = "".join(f"{line}\n" for line in lines) if lines is not None else None
    return run_quill(quill_home, "embed", str(model), *args, input_text=stdin)


def embed_bytes(quill_home: Path, model: Path, *args: str, stdin: bytes):
    """quill embed with stdin and stdout as bytes (a .npy matrix, a line that is not UTF-8)."""
    return subprocess.run(
        [QUILL, "embed", str(model), *args],
        input=stdin,
        capture_output=True,
        env=quill_env(quill_home),
        timeout=120,
    )


def vectors(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def reference_vectors(model: Path, texts: list[str]) -> np.ndarray:
    """llama-cpp-python's own embedding path (its Llama.embed: its batching, pooling and
    normalization, not quill's) over the same file."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(model), embedding=True, verbose=False, n_ctx=512, n_batch=512)
    try:
        return np.array(llm.embed(texts, normalize=True), dtype=np.float64)
    finally:
        llm.close()


def test_lines_on_stdin_give_llama_cpps_vectors_in_order(quill_home, minilm_path):
    result = embed(quill_home, minilm_path, lines=TEXTS)
    rows = vectors(result)
    assert [row["id"] for row in rows] == list(range(1, len(TEXTS) + 1))
    ours = np.array([row["vector"] for row in rows])
    assert ours.shape == (len(TEXTS), 384)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    theirs = reference_vectors(minilm_path, TEXTS)
    cosines = np.sum(ours * theirs, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosines.min() >= 0.9999, cosines
    assert all(row["tokens"] > 2 for row in rows)
    # Meaning: the paraphrase is nearer than the unrelated sentence.
    assert ours[0] @ ours[1] > ours[0] @ ours[2] + 0.2
    assert "8 texts" in result.stderr and "texts/s" in result.stderr


def test_one_text_small_batches_and_one_thread_agree(quill_home, tiny_bert_path):
    minilm_path = tiny_bert_path  # batching, on the tiny BERT (fast)
    whole = np.array([r["vector"] for r in vectors(embed(quill_home, minilm_path, lines=TEXTS))])
    small = embed(quill_home, minilm_path, "--batch", "16", "--threads", "1", lines=TEXTS)
    split = np.array([r["vector"] for r in vectors(small)])
    assert np.min(np.sum(whole * split, axis=1)) >= 0.9999
    one = vectors(embed(quill_home, minilm_path, TEXTS[3]))
    assert one[0]["id"] == 1 and float(np.dot(one[0]["vector"], whole[3])) >= 0.9999


def test_jsonl_ids_npy_pooling_and_normalization(quill_home, tiny_bert_path):
    minilm_path = tiny_bert_path  # the options' paths, on the tiny BERT (fast)
    records = [json.dumps({"id": f"doc-{n}", "text": t}) for n, t in enumerate(TEXTS[:3])]
    records.append(json.dumps({"id": 7, "content": TEXTS[3]}))
    rows = vectors(embed(quill_home, minilm_path, "--jsonl", lines=records))
    assert [r["id"] for r in rows] == ["doc-0", "doc-1", "doc-2", 7]
    stdin = "\n".join(TEXTS[:4]).encode() + b"\n"
    result = embed_bytes(quill_home, minilm_path, "--format", "npy", "--no-stats", stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert result.stderr == b""  # --no-stats: nothing but the matrix
    matrix = np.load(io.BytesIO(result.stdout))
    assert matrix.shape == (4, 32) and matrix.dtype == np.float32
    assert np.allclose(matrix, np.array([r["vector"] for r in rows]), atol=1e-6)


def test_normalization_and_pooling_change_the_vector_as_asked(quill_home, tiny_bert_path):
    minilm_path = tiny_bert_path
    unit = np.array(vectors(embed(quill_home, minilm_path, TEXTS[0]))[0]["vector"])
    matrix = unit[None]
    raw = vectors(embed(quill_home, minilm_path, "--normalize", "none", TEXTS[0]))[0]["vector"]
    assert abs(np.linalg.norm(raw) - 1.0) > 0.05  # a mean of token vectors is not unit length
    assert np.dot(raw, matrix[0]) / np.linalg.norm(raw) > 0.9999  # the same direction
    cls = vectors(embed(quill_home, minilm_path, "--pooling", "cls", TEXTS[0]))[0]["vector"]
    assert float(np.dot(cls, matrix[0])) < 0.99  # another pooling, another vector


def test_a_text_past_the_context_fails_with_its_length_unless_truncated(quill_home, tiny_bert_path):
    long_text = " ".join(["cat"] * 100)
    result = embed(quill_home, tiny_bert_path, lines=[TEXTS[0], long_text])
    assert result.returncode == 4
    assert "text 2 is 102 tokens; the model reads at most 64" in result.stderr
    assert "Traceback" not in result.stderr
    cut = vectors(embed(quill_home, tiny_bert_path, "--truncate", lines=[long_text]))
    assert cut[0]["tokens"] == 64


@pytest.mark.parametrize(
    ("stdin", "needle"),
    [
        (b"first\n\nthird\n", "line 2 is empty"),
        (b"fine\n\xff\xfe broken\n", "line 2 is not UTF-8"),
        (b"", "stdin held no text"),
        (b'{"text": "no id"}\n', 'line 1: expected {"id"'),
    ],
)
def test_bad_input_is_one_line_and_exit_2(quill_home, tiny_bert_path, stdin, needle):
    args = ["--jsonl"] if stdin.startswith(b"{") else []
    result = embed_bytes(quill_home, tiny_bert_path, *args, stdin=stdin)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr.decode()
    assert len(result.stderr.decode().strip().splitlines()) == 1
    assert result.stdout == b""


def test_run_refuses_an_embedding_model_and_embed_a_generation_model(
    quill_home, minilm_path, smollm2_path
):
    ran = run_quill(quill_home, "run", str(minilm_path), "hello")
    assert ran.returncode == 2
    assert "is an embedding model" in ran.stderr and "quill embed" in ran.stderr
    refused = embed(quill_home, smollm2_path, "hello")
    assert refused.returncode == 2 and "--pooling mean" in refused.stderr
    pooled = vectors(embed(quill_home, smollm2_path, "--pooling", "mean", "hello"))
    assert len(pooled[0]["vector"]) == 576  # SmolLM2's width, mean of its hidden states


def _lines(count: int) -> list[str]:
    subjects = ["The cat", "A train", "My sister", "The market", "This recipe", "Our server"]
    verbs = ["needs", "forgot", "improves", "breaks", "explains", "waits for"]
    things = ["the password", "a warm rug", "fresh basil", "the quarterly report", "a reboot"]
    return [
        f"{subjects[n % 6]} {verbs[n // 6 % 6]} {things[n // 36 % 5]} (note {n})"
        for n in range(count)
    ]


def _stored(home: Path, name: str) -> int:
    import sqlite3

    database = home / "collections.db"
    if not database.exists():
        return 0
    with contextlib.closing(sqlite3.connect(database, timeout=10)) as connection:
        try:
            row = connection.execute(
                "SELECT count(*) FROM items JOIN collections "
                "ON collections.id = items.collection_id WHERE collections.name = ?",
                (name,),
            ).fetchone()
        except sqlite3.OperationalError:  # the tables are being made
            return 0
    return int(row[0])


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_a_collection_survives_a_kill_and_resumes_without_embedding_again(
    tmp_path, minilm_path, stop, code
):
    home = tmp_path / "home"
    lines = _lines(1000)
    stdin = "".join(f"{line}\n" for line in lines).encode()
    process = subprocess.Popen(
        [QUILL, "embed", str(minilm_path), "--into", "notes", "--threads", "1"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=quill_env(home),
    )
    process.stdin.write(stdin)
    process.stdin.close()
    deadline = time.monotonic() + 60
    while _stored(home, "notes") < 100 and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(stop)
    assert process.wait(timeout=60) == code, process.stderr.read()
    kept = _stored(home, "notes")
    assert 100 <= kept < 1000  # whole batches of 64 only
    again = embed_bytes(home, minilm_path, "--into", "notes", stdin=stdin)
    assert again.returncode == 0, again.stderr
    assert f"{1000 - kept} texts" in again.stderr.decode()
    assert f"{kept} unchanged skipped" in again.stderr.decode()
    assert _stored(home, "notes") == 1000
    found = run_quill(home, "similar", "notes", "the cat forgot a warm rug", "-n", "3")
    assert found.returncode == 0, found.stderr
    ids = [int(line.split()[1]) for line in found.stdout.splitlines()]
    assert len(ids) == 3 and all(lines[i - 1].startswith("The cat") for i in ids)
    listed = run_quill(home, "collections", "--json")
    assert json.loads(listed.stdout)[0]["items"] == 1000


RANKED = ["hello world", "the cat sat on the mat", "a cat sat", "run , run", "the mat"]


def test_rerank_sorts_documents_by_the_rerankers_score(quill_home, tiny_reranker_path):
    stdin = "".join(f"{doc}\n" for doc in RANKED)
    every = run_quill(
        quill_home, "rerank", str(tiny_reranker_path), "the cat", "--json", input_text=stdin
    )
    assert every.returncode == 0, every.stderr
    rows = [json.loads(line) for line in every.stdout.splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(len(RANKED)))
    scores = [r["score"] for r in rows]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)
    assert all(RANKED[r["index"]] == r["document"] for r in rows)
    top = run_quill(
        quill_home, "rerank", str(tiny_reranker_path), "the cat", "-n", "2", input_text=stdin
    )
    assert top.returncode == 0 and "5 documents ranked" in top.stderr
    lines = top.stdout.splitlines()
    assert len(lines) == 2 and lines[0].split(maxsplit=1)[1] == rows[0]["document"]
    assert float(lines[0].split()[0]) == pytest.approx(rows[0]["score"], abs=1e-4)


def test_each_command_refuses_the_other_kinds(quill_home, tiny_bert_path, tiny_reranker_path):
    ranked = run_quill(quill_home, "rerank", str(tiny_bert_path), "q", input_text="doc\n")
    assert ranked.returncode == 2 and "is not a reranker" in ranked.stderr
    embedded = run_quill(quill_home, "embed", str(tiny_reranker_path), "text")
    assert embedded.returncode == 2 and "is a reranker" in embedded.stderr
    ran = run_quill(quill_home, "run", str(tiny_reranker_path), "hello")
    assert ran.returncode == 2 and "quill rerank" in ran.stderr
    empty = run_quill(quill_home, "rerank", str(tiny_reranker_path), " ", input_text="doc\n")
    assert empty.returncode == 2 and "the query is empty" in empty.stderr


def test_inspect_and_list_say_what_a_model_is_for(quill_home, tiny_bert_path, tiny_reranker_path):
    shown = run_quill(quill_home, "inspect", str(tiny_bert_path), "--json")
    facts = json.loads(shown.stdout)
    assert (facts["kind"], facts["pooling"]) == ("embedding", "mean")
    ranked = json.loads(run_quill(quill_home, "inspect", str(tiny_reranker_path), "--json").stdout)
    assert ranked["kind"] == "rerank"
    text = run_quill(quill_home, "inspect", str(tiny_bert_path)).stdout
    assert "pooling           mean" in text and "embedding model" in text


def test_the_other_options_by_their_long_names(quill_home, tiny_bert_path, tiny_reranker_path):
    path = str(tiny_bert_path)
    l1 = vectors(run_quill(quill_home, "embed", path, "--normalize", "l1", "the cat"))
    assert np.sum(np.abs(l1[0]["vector"])) == pytest.approx(1.0, abs=1e-4)
    peak = vectors(run_quill(quill_home, "embed", path, "--normalize", "max", "the cat"))
    assert np.max(np.abs(peak[0]["vector"])) == pytest.approx(32760, rel=1e-4)
    text = "hello world , the cat sat on the mat"
    last = vectors(run_quill(quill_home, "embed", path, "--pooling", "last", "--offline", text))
    mean = vectors(run_quill(quill_home, "embed", path, "--verbose", text))
    assert float(np.dot(last[0]["vector"], mean[0]["vector"])) < 0.99
    ranked = run_quill(
        quill_home, "rerank", str(tiny_reranker_path), "the cat", "--batch", "16", "--threads",
        "1", "--truncate", "--offline", "--no-stats", "--verbose",
        input_text=" ".join(["cat"] * 100) + "\nhello world\n",
    )  # fmt: skip
    assert ranked.returncode == 0, ranked.stderr
    assert len(ranked.stdout.splitlines()) == 2  # the long document was cut, not refused
    assert "llama_model_loader" in ranked.stderr  # --verbose: llama.cpp's own log
    bad = run_quill(quill_home, "embed", path, "--normalize", "l3", "cat")
    assert bad.returncode == 2 and "choose one of l2, l1, max, none" in bad.stderr


def test_similar_finds_by_id_and_text_in_a_collection(tmp_path, tiny_bert_path):
    home = tmp_path / "home"
    stdin = "hello world\nthe cat sat on the mat\na cat sat\nrun , run\n"
    made = run_quill(home, "embed", str(tiny_bert_path), "--into", "tiny", input_text=stdin)
    assert made.returncode == 0, made.stderr
    by_id = run_quill(home, "similar", "tiny", "--id", "2", "--json", "-n", "1")
    assert by_id.returncode == 0, by_id.stderr
    assert json.loads(by_id.stdout)["id"] in ("1", "3", "4")  # never the item itself
    by_text = run_quill(
        home, "similar", "tiny", "the cat sat on the mat", "--number", "1", "--threads", "1",
        "--truncate", "--offline",
    )  # fmt: skip
    assert by_text.returncode == 0, by_text.stderr
    score, best = by_text.stdout.split()
    assert best == "2" and float(score) == pytest.approx(1.0, abs=1e-3)
    pooled = run_quill(home, "embed", str(tiny_bert_path), "--into", "x", "--pooling", "cls", "a")
    assert pooled.returncode == 2 and "drop --pooling" in pooled.stderr


def _peak_rss_kib(home: Path, model: Path, stdin: bytes) -> int:
    """quill embed over stdin, its output drained as it comes: the process's peak RSS."""
    import os
    import threading

    process = subprocess.Popen(
        [QUILL, "embed", str(model), "--no-stats"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=quill_env(home),
    )
    assert process.stdout is not None and process.stdin is not None
    counted: list[int] = []
    reader = threading.Thread(target=lambda: counted.append(sum(1 for _ in process.stdout)))
    reader.start()
    process.stdin.write(stdin)
    process.stdin.close()
    _, status, usage = os.wait4(process.pid, 0)
    reader.join()
    assert os.waitstatus_to_exitcode(status) == 0
    assert counted == [stdin.count(b"\n")]
    return usage.ru_maxrss


@pytest.mark.slow
def test_a_hundred_thousand_lines_run_in_bounded_memory(tmp_path, tiny_bert_path):
    words = ["hello", "world", "the", "cat", "sat", "on", "mat", "run", "a", "cafe"]
    lines = [" ".join(words[(n * 7 + k) % 10] for k in range(3 + n % 9)) for n in range(100_000)]
    every = "".join(f"{line}\n" for line in lines).encode()
    few = _peak_rss_kib(tmp_path, tiny_bert_path, b"".join(every.splitlines(True)[:1000]))
    many = _peak_rss_kib(tmp_path, tiny_bert_path, every)
    # Kept whole, 100,000 vectors and their JSON would take tens of MiB more.
    assert many - few < 8 * 1024, (few, many)


def test_a_terminal_sees_a_progress_count_and_a_pipe_only_the_stats_line(
    tmp_path, quill_home, tiny_bert_path
):
    import pexpect

    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"hello world the cat {n}\n" for n in range(3000)))
    command = f"{QUILL} embed {tiny_bert_path} --threads 1 < {lines} > /dev/null"
    child = pexpect.spawn("bash", ["-c", command], env=quill_env(quill_home), encoding="utf-8")
    shown = child.read()
    child.wait()
    assert "embedding" in shown and "3000/?" in shown and "3000 texts" in shown
    piped = run_quill(quill_home, "embed", str(tiny_bert_path), input_text=lines.read_text())
    assert piped.stderr.count("\n") == 1 and "3000 texts" in piped.stderr
    assert "\x1b[" not in piped.stderr  # no colour and no bar into a pipe

"""Rerank scores: quill rerank and quill serve's /v1/rerank against llama-server --rerank built
from the same sdist, on one reranker file and the same query and documents (issue 44: equal
within 1e-3). No reranker can be had offline here, so by default the file is the tests' tiny
cross-encoder (tests/tinybert.py: a random BERT with a one-label classifier head, converted as
llama.cpp's converter writes rerankers); --model takes a real one.

Usage (inside quill's venv):
  python -m benchmarks.rerank_vs_llama_server [--model RERANKER.gguf] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx2 as httpx

from benchmarks.harness import QUILL, ROOT, TOOLS, machine_line, serving, users_env

QUERY = "the cat"
DOCUMENTS = [
    "hello world",
    "the cat sat on the mat",
    "a cat sat",
    "run , run",
    "the mat",
    "cafe 123 , unbelievable",
    "the cat sat on the mat ! the cat sat on the mat",
    "我 run the cat",
]


def tiny_reranker(folder: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))  # tests/tinybert.py, as the tests make it
    from tinybert import tiny_gguf

    return tiny_gguf(folder / "tiny-reranker", folder / "tiny-reranker.gguf", reranker=True)


def scores_of(results: list[dict], key: str) -> dict[int, float]:
    return {int(r["index"]): float(r[key]) for r in results}


def quill_scores(model: Path, documents: list[str]) -> dict[int, float]:
    cli = subprocess.run(
        [QUILL, "rerank", str(model), QUERY, "--json", "--no-stats", "--threads", "2"],
        input="".join(f"{doc}\n" for doc in documents), capture_output=True, text=True,
        check=True, env=users_env(),
    )  # fmt: skip
    return scores_of([json.loads(line) for line in cli.stdout.splitlines()], "score")


def served_scores(url: str, model: Path, documents: list[str]) -> dict[int, float]:
    body = {"model": str(model), "query": QUERY, "documents": documents}
    results = httpx.post(url + "/v1/rerank", json=body, timeout=120).json()["results"]
    return scores_of(results, "relevance_score")


def each_alone(score: Callable[[list[str]], dict[int, float]]) -> dict[int, float]:
    """Each document in a request of its own: one sequence a decode, on both sides."""
    return {n: score([doc])[0] for n, doc in enumerate(DOCUMENTS)}


def measure(model: Path) -> dict:
    server = [str(TOOLS / "llama-server"), "-m", str(model), "--rerank", "-t", "2"]
    with serving(server) as (_, url):
        theirs = served_scores(url, model, DOCUMENTS)
        theirs_alone = each_alone(lambda docs: served_scores(url, model, docs))
    with serving([QUILL, "serve", str(model), "--threads", "2"], users_env()) as (_, url):
        served = served_scores(url, model, DOCUMENTS)
        served_alone = each_alone(lambda docs: served_scores(url, model, docs))
    cli, cli_alone = quill_scores(model, DOCUMENTS), each_alone(lambda d: quill_scores(model, d))
    scores = {
        "llama_server": theirs, "llama_server_each_alone": theirs_alone,
        "quill_serve": served, "quill_serve_each_alone": served_alone,
        "quill_rerank": cli, "quill_rerank_each_alone": cli_alone,
    }  # fmt: skip

    def largest(ours: dict[int, float], reference: dict[int, float]) -> float:
        return max(abs(ours[i] - reference[i]) for i in range(len(DOCUMENTS)))

    return {
        "machine": machine_line(),
        "model": str(model),
        "query": QUERY,
        "documents": DOCUMENTS,
        "scores": scores,
        "largest_difference": {
            "each_alone": max(
                largest(served_alone, theirs_alone), largest(cli_alone, theirs_alone)
            ),
            "one_request": max(largest(served, theirs), largest(cli, theirs)),
            "llama_server_one_request_vs_each_alone": largest(theirs, theirs_alone),
            "quill_one_request_vs_each_alone": largest(cli, cli_alone),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a reranker GGUF (default: the tiny one)")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(args.model or tiny_reranker(Path(scratch)))
    names = list(result["scores"])
    print(" ".join(f"{name[:22]:>22}" for name in names))
    for index, document in enumerate(DOCUMENTS):
        print(" ".join(f"{result['scores'][n][index]:22.6f}" for n in names), document)
    for what, value in result["largest_difference"].items():
        verdict = "within" if value <= 1e-3 else "past"
        print(f"largest difference, {what}: {value:.2e} ({verdict} 1e-3)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()

"""/v1/embeddings and /v1/rerank through quill serve: the official openai client, an embedding
model beside a chat model in one pool, concurrent clients batched together, and hostile input
answered with a 400 while the server goes on."""

from __future__ import annotations

import base64
import concurrent.futures
import json
import time

import httpx2 as httpx
import numpy as np
import pytest
from test_embed import TEXTS, reference_vectors

from conftest import KEY, start_server

HEADERS = {"Authorization": f"Bearer {KEY}"}
MINILM = CHAT = RANKER = ""  # the models' names in the servers: their paths


@pytest.fixture(scope="module")
def embed_server(quill_home, tmp_path_factory, minilm_path, smollm2_path):
    """MiniLM and SmolLM2 in one server's pool, each named by its path."""
    global MINILM, CHAT
    MINILM, CHAT = str(minilm_path), str(smollm2_path)
    tmp = tmp_path_factory.mktemp("embed-server")
    process, url = start_server(quill_home, tmp, MINILM, CHAT, "--api-key", KEY)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_server(quill_home, tmp_path_factory, tiny_bert_path, tiny_reranker_path, tiny_path):
    """The tiny BERT, the tiny reranker and the tiny chat model in one pool (fast tier): the
    model names in the tests below are theirs, set here."""
    global TINY_BERT, RANKER, TINY_CHAT
    TINY_BERT, RANKER, TINY_CHAT = map(str, (tiny_bert_path, tiny_reranker_path, tiny_path))
    tmp = tmp_path_factory.mktemp("tiny-embed-server")
    process, url = start_server(
        quill_home, tmp, TINY_BERT, RANKER, TINY_CHAT, "--api-key", KEY, "--max-models", "3"
    )
    yield url
    process.terminate()
    process.wait(timeout=30)


TINY_BERT = TINY_CHAT = ""


def post(url: str, path: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=HEADERS, timeout=timeout)


def test_the_openai_client_gets_llama_cpps_vectors(embed_server, minilm_path):
    from openai import OpenAI

    client = OpenAI(base_url=embed_server + "/v1", api_key=KEY)
    reply = client.embeddings.create(model=MINILM, input=TEXTS)
    ours = np.array([item.embedding for item in reply.data])
    # same path: the reply's indexes are its order, not computed text
    assert [item.index for item in reply.data] == list(range(len(TEXTS)))
    theirs = reference_vectors(minilm_path, TEXTS)
    assert np.min(np.sum(ours * theirs, axis=1) / np.linalg.norm(theirs, axis=1)) >= 0.9999
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(TEXTS) * 3
    # The client's default asks for base64; float is the plain JSON form of the same numbers.
    plain = post(embed_server, "/v1/embeddings", {"model": MINILM, "input": TEXTS[0]})
    assert plain.status_code == 200, plain.text
    alone = np.array(plain.json()["data"][0]["embedding"])
    assert float(alone @ ours[0]) >= 0.9999  # another batch shape: not bit-identical
    coded = post(
        embed_server,
        "/v1/embeddings",
        {"model": MINILM, "input": [TEXTS[0]], "encoding_format": "base64"},
    ).json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(coded), "<f4"), alone, atol=1e-7)


def test_token_arrays_are_embedded_as_given(embed_server):
    text = post(embed_server, "/v1/embeddings", {"model": MINILM, "input": "hello world"})
    # [CLS] hello world [SEP] in BERT's uncased vocabulary.
    ids = post(embed_server, "/v1/embeddings", {"model": MINILM, "input": [[101, 7592, 2088, 102]]})
    assert ids.status_code == 200, ids.text
    a, b = text.json()["data"][0]["embedding"], ids.json()["data"][0]["embedding"]
    assert float(np.dot(a, b)) >= 0.9999
    flat = post(embed_server, "/v1/embeddings", {"model": MINILM, "input": [101, 7592, 102]})
    assert flat.status_code == 200 and len(flat.json()["data"]) == 1


def test_concurrent_clients_share_batches_and_get_their_own_vectors(embed_server):
    alone = [
        post(embed_server, "/v1/embeddings", {"model": MINILM, "input": t}).json()
        for t in TEXTS[:4]
    ]

    def ask(text: str) -> dict:
        return post(embed_server, "/v1/embeddings", {"model": MINILM, "input": [text] * 8}).json()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, TEXTS[:4]))
    for one, many in zip(alone, together, strict=True):
        # same path: indexes number each request's own inputs, however the pass grouped them
        assert [item["index"] for item in many["data"]] == list(range(8))
        for item in many["data"]:
            assert float(np.dot(item["embedding"], one["data"][0]["embedding"])) >= 0.9999


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"input": ""}, "'input' is empty"),
        ({"input": []}, "non-empty array"),
        ({"input": ["fine", "  "]}, "'input[1]' is empty"),
        ({"input": ["x"] * 100_000}, "100000 items"),
        ({"input": " ".join(["cat"] * 100)}, "102 tokens; the model reads at most 64"),
        ({"input": [[2, 10_000_000, 3]]}, "not a token id"),
        ({"input": [[2, 28, 3]]}, "not a token id of this model (0 to 27)"),
        ({"input": [[2, -1, 3]]}, "not a token id"),
        ({"input": [[2, True, 3]]}, "not a token id"),
        ({"input": "\ud800 lone"}, "lone surrogate"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 5}, "'input' must be"),
    ],
)
def test_hostile_input_is_a_400_and_the_server_goes_on(tiny_server, body, needle):
    reply = post(tiny_server, "/v1/embeddings", {"model": TINY_BERT, **body})
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]
    fine = post(tiny_server, "/v1/embeddings", {"model": TINY_BERT, "input": "still here"})
    assert fine.status_code == 200


def test_invalid_utf8_in_the_body_is_a_400(tiny_server):
    body = b'{"model": "%s", "input": "\xff\xfe"}' % TINY_BERT.encode()
    reply = post(tiny_server, "/v1/embeddings", body)
    assert reply.status_code == 400


def test_each_model_kind_refuses_the_others_requests(tiny_server):
    chat = post(
        tiny_server,
        "/v1/chat/completions",
        {"model": TINY_BERT, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 400 and "does not generate text" in chat.json()["error"]["message"]
    vectors = post(tiny_server, "/v1/embeddings", {"model": TINY_CHAT, "input": "hi"})
    assert vectors.status_code == 400 and "generates text" in vectors.json()["error"]["message"]
    ranked = post(tiny_server, "/v1/rerank", {"model": TINY_BERT, "query": "q", "documents": ["d"]})
    assert ranked.status_code == 400 and "not a reranker" in ranked.json()["error"]["message"]
    embedded = post(tiny_server, "/v1/embeddings", {"model": RANKER, "input": "cat"})
    assert embedded.status_code == 400 and "/v1/rerank" in embedded.json()["error"]["message"]
    answered = post(
        tiny_server,
        "/v1/chat/completions",
        {"model": TINY_CHAT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert answered.status_code == 200
    health = httpx.get(tiny_server + "/health", headers=HEADERS, timeout=30).json()
    assert health["status"] == "ok" and health["models_loaded"] == 3


def test_rerank_answers_as_llama_server_and_as_quill_rerank(tiny_server, quill_home):
    from test_embed import RANKED

    from conftest import run_quill

    body = {"model": RANKER, "query": "the cat", "documents": RANKED, "top_n": 3}
    reply = post(tiny_server, "/v1/rerank", {**body, "return_documents": True})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["object"] == "list" and answer["usage"]["prompt_tokens"] > len(RANKED) * 4
    results = answer["results"]
    assert len(results) == 3
    assert [r["document"]["text"] for r in results] == [RANKED[r["index"]] for r in results]
    stdin = "".join(f"{doc}\n" for doc in RANKED)
    cli = run_quill(quill_home, "rerank", RANKER, "the cat", "--json", "-n", "3", input_text=stdin)
    by_cli = [json.loads(line) for line in cli.stdout.splitlines()]
    assert [r["index"] for r in by_cli] == [r["index"] for r in results]
    for ours, served in zip(by_cli, results, strict=True):
        assert ours["score"] == pytest.approx(served["relevance_score"], abs=1e-3)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"query": "", "documents": ["a"]}, "'query' must be a non-empty string"),
        ({"query": "q", "documents": []}, "'documents' must be a non-empty array"),
        ({"query": "q", "documents": ["a", 5]}, "'documents[1]' must be a string"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "'top_n'"),
        ({"query": "q", "documents": ["cat " * 100]}, "the model reads at most 64"),
        ({"query": "q", "documents": ["a"] * 100_000}, "100000 items"),
    ],
)
def test_hostile_rerank_bodies_are_a_400(tiny_server, body, needle):
    reply = post(tiny_server, "/v1/rerank", {"model": RANKER, **body})
    assert reply.status_code == 400, reply.text
    assert needle in reply.json()["error"]["message"]


def test_requests_waiting_together_share_a_pass_and_keep_their_own_numbering(tiny_bert_path):
    from cli.engine.embedding import Embedder
    from cli.engine.embedqueue import EmbeddingJob, EmbeddingScheduler
    from cli.engine.options import LoadOptions

    embedder = Embedder(tiny_bert_path, LoadOptions(threads=1))
    scheduler = EmbeddingScheduler(embedder)
    try:
        cat, world = embedder.tokenize("the cat sat"), embedder.tokenize("hello world")
        first = EmbeddingJob([cat] * 3000)  # busy the loop while the next two wait together
        scheduler.submit(first)
        while not scheduler.busy_slots:  # the first pass has taken it: the next two queue
            time.sleep(0.001)
        second, third = EmbeddingJob([cat] * 5), EmbeddingJob([world] * 7)
        scheduler.submit(second)
        scheduler.submit(third)
        for job in (first, second, third):
            assert job.done.wait(60) and job.error is None
        assert scheduler.max_sequences_in_a_step == 3000
        assert scheduler.steps == 2  # the two waiting requests shared one pass
        assert [r.index for r in second.results] == list(range(5))
        assert [r.index for r in third.results] == list(range(7))
        assert float(third.results[6].vector @ second.results[0].vector) < 0.999
    finally:
        scheduler.close()
        embedder.close()

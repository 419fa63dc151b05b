"""quill serve's /metrics (off unless --metrics; Prometheus's text format, read back by
prometheus_client's own parser, its counts checked against the requests the test sent, model
loads and evictions included) and llama-server's /tokenize and /detokenize (checked against the
engine's tokenizer in this process), on tiny models the tests write."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions

from conftest import KEY, start_server
from tinymodel import write_tiny_llama

AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("metrics-models")
    return (
        write_tiny_llama(folder / "first.gguf", n_layer=1),
        write_tiny_llama(folder / "second.gguf", n_layer=2),
    )


@pytest.fixture(scope="module")
def served(tiny_models, quill_home, tmp_path_factory) -> Iterator[str]:
    first, second = tiny_models
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve-metrics"),
        str(first), str(second),
        "--max-models", "1", "--ctx", "512", "--parallel", "2", "--metrics", "--api-key", KEY,
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, labels) -> value."""
    reply = httpx.get(f"{url}/metrics", headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/plain; version=")
    assert int(reply.headers["process-start-time-unix"]) > 0  # llama-server's header
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(url: str, model: str, content: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 6}
    return httpx.post(f"{url}/v1/chat/completions", json=body | extra, headers=AUTH, timeout=120)


def test_metrics_count_what_was_sent(served: str, tiny_models) -> None:
    first, second = (str(path) for path in tiny_models)
    before = scrape(served)
    route = "/v1/chat/completions"
    usages = []
    for words in ("one two", "three four five", "six"):
        reply = chat(served, first, words, seed=1)
        assert reply.status_code == 200, reply.text
        usages.append(reply.json()["usage"])
    with httpx.stream(
        "POST", f"{served}/v1/chat/completions", headers=AUTH, timeout=120,
        json={"model": first, "messages": [{"role": "user", "content": "red"}], "max_tokens": 5,
              "stream": True, "stream_options": {"include_usage": True}},
    ) as stream:  # fmt: skip
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usages.append(json.loads(lines[-1][6:])["usage"])
    refused = chat(served, first, "x", temperature=9)
    assert refused.status_code == 400

    after = scrape(served)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("quill_requests_total", route=route, model=first, status="200") == 4
    # The 400 came after the model was acquired: it is counted under the model.
    assert grew("quill_requests_total", route=route, model=first, status="400") == 1
    assert grew("quill_prompt_tokens_total", model=first) == sum(u["prompt_tokens"] for u in usages)
    assert grew("quill_generated_tokens_total", model=first) == sum(
        u["completion_tokens"] for u in usages
    )
    assert grew("quill_cached_prompt_tokens_total", model=first) == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert grew("quill_time_to_first_token_seconds_count", model=first) == 4
    assert grew("quill_decode_tokens_per_second_count", model=first) == 4
    # llama-server's names, for dashboards made for it: prefilled apart from cached
    prefilled = sum(
        u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert grew("llamacpp:prompt_tokens_total") == prefilled
    assert grew("llamacpp:prompt_tokens_cached_total") == sum(
        u["prompt_tokens_details"]["cached_tokens"] for u in usages
    )
    assert grew("llamacpp:tokens_predicted_total") == sum(u["completion_tokens"] for u in usages)
    assert grew("llamacpp:n_decode_total") >= sum(u["completion_tokens"] for u in usages)
    assert value(after, "llamacpp:requests_processing") == 0
    assert value(after, "quill_models_loaded") == 1
    assert value(after, "quill_slots", model=first) == 2
    assert value(after, "quill_slots_busy", model=first) == 0
    assert value(after, "quill_model_memory_bytes", model=first) > 0

    # The second model evicts the first (--max-models 1): a load and an eviction, counted.
    assert chat(served, second, "blue").status_code == 200
    swapped = scrape(served)
    assert value(swapped, "quill_model_loads_total", model=second) == 1
    assert value(swapped, "quill_model_unloads_total", model=first, reason="evicted") >= 1
    assert value(swapped, "quill_models_loaded") == 1
    assert (
        value(swapped, "quill_requests_total", route="/metrics", model="", status="200")
        == value(after, "quill_requests_total", route="/metrics", model="", status="200") + 1
    )


def test_metrics_need_the_key_and_bound_their_labels(served: str) -> None:
    refused = httpx.get(f"{served}/metrics", timeout=30)
    assert refused.status_code == 401
    for path in ("/no/such/route/1", "/no/such/route/2"):
        assert httpx.get(f"{served}{path}", headers=AUTH, timeout=30).status_code == 404
    samples = scrape(served)
    routes = {dict(labels).get("route") for (name, labels) in samples if "requests" in name}
    assert "other" in routes and not any(r and r.startswith("/no/") for r in routes)


def test_metrics_are_off_without_the_flag(tiny_models, quill_home, tmp_path) -> None:
    process, url = start_server(quill_home, tmp_path, str(tiny_models[0]), "--ctx", "256")
    try:
        reply = httpx.get(f"{url}/metrics", timeout=30)
        assert reply.status_code == 501  # llama-server's answer: not supported here
        error = reply.json()["error"]
        assert "--metrics" in error["message"] and error["type"] == "not_supported_error"
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_tokenize_and_detokenize_agree_with_the_engine(served: str, tiny_models) -> None:
    first = str(tiny_models[0])
    text = 'The red fox, in JSON: {"kind": true} é'
    with Engine(tiny_models[0], LoadOptions(n_ctx=256, threads=1)) as engine:
        plain = engine.vocabulary.tokenize_bytes(text.encode(), False)
        with_bos = engine.vocabulary.tokenize_bytes(text.encode(), True)
        pieces = [engine.piece(token, True) for token in plain]

    def post(path: str, **body) -> httpx.Response:
        return httpx.post(
            f"{served}{path}", json={"model": first, **body}, headers=AUTH, timeout=60
        )

    # same path: the model's tokenizer here and in the server; nothing is generated
    assert post("/tokenize", content=text).json() == {"tokens": plain}
    # same path: as above
    assert post("/tokenize", content=text, add_special=True).json() == {"tokens": with_bos}
    # (The tiny vocabulary adds no BOS, so both are equal here; the engine says what it adds.)
    shown = post("/tokenize", content=text, with_pieces=True).json()["tokens"]
    assert [entry["id"] for entry in shown] == plain
    for entry, piece in zip(shown, pieces, strict=True):
        expected = piece.decode() if _whole_utf8(piece) else list(piece)
        assert entry["piece"] == expected
    # same path: the tokenizer's pieces, joined
    assert post("/detokenize", tokens=plain).json() == {"content": text}

    for path, body, needle in [
        ("/tokenize", {"content": 5}, "'content' must be"),
        ("/tokenize", {"content": "a", "with_pieces": "yes"}, "'with_pieces' must be true"),
        ("/tokenize", {"content": "a", "parse_special": False}, "parse_special false"),
        ("/detokenize", {"tokens": "1 2"}, "'tokens' must be an array"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1] is not a token id"),
        ("/detokenize", {"tokens": [1, 10**12]}, "tokens[1] is not a token id"),
        ("/detokenize", {"tokens": [True]}, "tokens[0] is not a token id"),
    ]:
        reply = post(path, **body)
        assert reply.status_code == 400, (path, body, reply.text)
        assert needle in reply.json()["error"]["message"], reply.text
    assert post("/tokenize", content="still answering").status_code == 200


def _whole_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True

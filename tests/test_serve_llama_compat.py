"""What a llama-server user types and sends, on quill serve (issue 50): --alias, a one-model
server answering any model name (and --strict-model refusing it), the request defaults
--temp, --seed and --n-predict, on tiny models the tests write."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from conftest import start_server
from tinymodel import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("compat-models")
    return (
        write_tiny_llama(folder / "first.gguf", n_layer=1),
        write_tiny_llama(folder / "second.gguf", n_layer=2),
    )


@pytest.fixture(scope="module")
def aliased(tiny_models, quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve-alias"),
        str(tiny_models[0]),
        "--alias", "tiny", "-a", "tiny-too", "--n-predict", "3", "--temp", "0", "--seed", "7",
        "--ctx", "256", "--parallel", "1",
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_an_alias_names_the_model_and_a_one_model_server_answers_any_name(aliased: str) -> None:
    listed = httpx.get(f"{aliased}/v1/models", timeout=30).json()["data"]
    assert [model["id"] for model in listed] == ["tiny"]
    client = openai.OpenAI(base_url=f"{aliased}/v1", api_key="none", max_retries=0)
    for name in ("tiny", "tiny-too", "gpt-3.5-turbo"):
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "red"}]
        )
        assert reply.model == "tiny"
        # --n-predict 3: a request that says no max_tokens generates 3 at most
        assert reply.usage.completion_tokens <= 3
        assert reply.choices[0].finish_reason in ("length", "stop")
    longer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "red"}], max_tokens=6,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert longer.usage.completion_tokens == 6  # a request's own max_tokens still rules


def test_temp_and_seed_are_the_defaults_of_requests_that_set_none(
    tiny_models, quill_home, tmp_path
) -> None:
    """--temp 0 makes a request without a temperature greedy: its tokens are the most likely
    at each step (logprobs say which), where the default 0.8 samples."""
    process, url = start_server(
        quill_home, tmp_path, str(tiny_models[0]), "--temp", "0", "--ctx", "256",
        "--parallel", "1",
    )  # fmt: skip
    try:
        body = {"messages": [{"role": "user", "content": "red blue"}], "max_tokens": 8,
                "logprobs": True, "top_logprobs": 1, "ignore_eos": True}  # fmt: skip
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        for entry in reply["choices"][0]["logprobs"]["content"]:
            best = entry["top_logprobs"][0]
            assert entry["logprob"] >= best["logprob"] - 1e-6, entry
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_strict_model_refuses_an_unknown_name_and_several_models_always_do(
    tiny_models, quill_home, tmp_path
) -> None:
    body = {"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}  # fmt: skip
    for args in (
        (str(tiny_models[0]), "--strict-model"),
        (str(tiny_models[0]), str(tiny_models[1])),
    ):
        process, url = start_server(quill_home, tmp_path, *args, "--ctx", "256")
        try:
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert reply.status_code == 404, reply.text
            message = reply.json()["error"]["message"]
            assert "'gpt-3.5-turbo' does not exist" in message and "first.gguf" in message
        finally:
            process.terminate()
            process.wait(timeout=30)

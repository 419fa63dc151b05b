"""What a llama-server user types and sends, on quill serve (issue 50): --alias, a one-model
server answering any model name (and --strict-model refusing it), the request defaults
--temp, --seed and --n-predict, on tiny models the tests write."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("several", [False, True], ids=["strict", "several models"])
def test_strict_model_refuses_an_unknown_name_and_several_models_always_do(
    tiny_models, quill_home, tmp_path, several: bool
) -> None:
    body = {"model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2}  # fmt: skip
    args = (str(tiny_models[0]), str(tiny_models[1]) if several else "--strict-model")
    process, url = start_server(quill_home, tmp_path, *args, "--ctx", "256")
    try:
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 404, reply.text
        message = reply.json()["error"]["message"]
        assert "'gpt-3.5-turbo' does not exist" in message and "first.gguf" in message
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def compat(tiny_models, quill_home, tmp_path_factory) -> Iterator[str]:
    """A server as a llama-server user starts one: its flags, two slots, a key, CORS for this
    machine's pages."""
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve-compat"),
        "--model", str(tiny_models[0]),
        "--alias", "tinyllama-2,fim,code", "--seed", "42", "--ctx-size", "256", "-np", "2",
        "--api-key", "compat-key", "--cors", "localhost",
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


KEYED = {"Authorization": "Bearer compat-key"}


def test_props_slots_and_models_answer_as_llama_servers(compat: str, tiny_models) -> None:
    props = httpx.get(f"{compat}/props", headers=KEYED, timeout=30).json()
    assert props["model_path"] == str(tiny_models[0]) and props["total_slots"] == 2
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == 256  # quill's -c is each slot's context
    assert settings["params"]["seed"] == 42 and settings["params"]["temperature"] == 0.8
    assert "<|im_start|>" in props["chat_template"]
    slots = httpx.get(f"{compat}/slots", headers=KEYED, timeout=30).json()
    assert [(slot["id"], slot["n_ctx"], slot["is_processing"]) for slot in slots] == [
        (0, 256, False), (1, 256, False)
    ]  # fmt: skip
    for path in ("/models", "/v1/models"):
        (model,) = httpx.get(f"{compat}{path}", headers=KEYED, timeout=30).json()["data"]
        assert model["id"] == "tinyllama-2"
        assert set(model["aliases"]) == {"tinyllama-2", "fim", "code"}
    for path in ("/health", "/v1/health"):  # no key needed
        assert httpx.get(f"{compat}{path}", timeout=30).json()["status"] == "ok"


def test_unprefixed_routes_and_apply_template(compat: str, tiny_models) -> None:
    messages = [{"role": "user", "content": "red"}]
    reply = httpx.post(
        f"{compat}/chat/completions", headers=KEYED, timeout=60,
        json={"model": "code", "messages": messages, "max_tokens": 2},
    ).json()  # fmt: skip
    assert reply["object"] == "chat.completion" and reply["model"] == "tinyllama-2"
    rendered = httpx.post(
        f"{compat}/apply-template", headers=KEYED, json={"messages": messages}, timeout=60
    ).json()["prompt"]
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    with Engine(tiny_models[0], LoadOptions(n_ctx=256, threads=1)) as engine:
        # same path: one template rendered twice; no model runs
        assert rendered == engine.chat_prompt(messages)
        assert reply["usage"]["prompt_tokens"] == len(engine.tokenize(rendered))


def test_errors_carry_llama_servers_types(compat: str) -> None:
    unkeyed = httpx.post(f"{compat}/v1/chat/completions", json={}, timeout=30)
    assert unkeyed.status_code == 401
    assert unkeyed.json()["error"]["type"] == "authentication_error"
    long = [{"role": "user", "content": "red blue green " * 200}]
    refused = httpx.post(
        f"{compat}/chat/completions", headers=KEYED, json={"messages": long}, timeout=60
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (
        error["type"] == "exceed_context_size_error" and error["code"] == "context_length_exceeded"
    )
    assert error["n_ctx"] == 256 and error["n_prompt_tokens"] > 256
    image = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "What is this?"},
    ]}]  # fmt: skip
    refused = httpx.post(
        f"{compat}/chat/completions", headers=KEYED, json={"messages": image}, timeout=60
    )
    assert refused.status_code == 400
    assert "read text only" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [("http://localhost:3000", True), ("http://127.0.0.1", True), ("http://[::1]:8080", True),
     ("http://localhost.evil.com", False), ("http://evil.com", False)],
)  # fmt: skip
def test_cors_localhost_allows_this_machines_pages_only(compat: str, origin, allowed) -> None:
    preflight = httpx.options(
        f"{compat}/completions", timeout=30,
        headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "Authorization"},
    )  # fmt: skip
    if allowed:
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
    else:
        assert preflight.status_code == 400
        assert "access-control-allow-origin" not in preflight.headers


def test_several_hosts_each_answer_and_no_slots_is_501(tiny_models, quill_home, tmp_path) -> None:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        hosts = "127.0.0.1,::1"
    except OSError:
        hosts = "127.0.0.1,localhost"  # no IPv6 loopback here: two names of one address
    process, url = start_server(
        quill_home, tmp_path, str(tiny_models[0]), "--host", hosts, "--no-slots", "--ctx", "256"
    )
    try:
        port = url.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "[::1]" if "::1" in hosts else "localhost"):
            health = httpx.get(f"http://{host}:{port}/health", timeout=30)
            assert health.status_code == 200, host
        refused = httpx.get(f"{url}/slots", timeout=30)
        assert refused.status_code == 501 and "--no-slots" in refused.json()["error"]["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_logit_bias_bans_and_refuses_what_it_cannot_read(aliased: str) -> None:
    """OpenAI's {"token id": bias} and llama-server's forms (a text key, [token, bias] pairs,
    false): a banned token never comes, whatever the greedy pick would have been."""

    def first_tokens(**extra) -> list[int]:
        body = {"prompt": "red blue", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "return_tokens": True, **extra}  # fmt: skip
        reply = httpx.post(f"{aliased}/completion", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    greedy = first_tokens()
    for form in (
        {str(greedy[0]): -100},
        [[greedy[0], False]],
        {str(token): -100 for token in greedy},
    ):
        banned = [int(key) for key in form] if isinstance(form, dict) else [form[0][0]]
        assert not set(banned) & set(first_tokens(logit_bias=form)), form
    pieces = httpx.post(
        f"{aliased}/tokenize", json={"content": "red", "with_pieces": True}, timeout=30
    ).json()["tokens"]
    as_text = first_tokens(logit_bias={"red": -100})
    assert not {piece["id"] for piece in pieces} & set(as_text)
    for bad, needle in (
        ({"5": 500}, "from -100 to 100"),
        ({"99999999": -5}, "vocabulary"),
        ("ban", "must map token ids"),
        ([[1, 2, 3]], "must map token ids"),
    ):
        reply = httpx.post(
            f"{aliased}/v1/completions",
            json={"prompt": "red", "max_tokens": 2, "logit_bias": bad}, timeout=30,
        )  # fmt: skip
        assert reply.status_code == 400 and needle in reply.json()["error"]["message"], bad


def test_chat_template_takes_llama_cpps_built_in_names(tiny_models, quill_home, tmp_path) -> None:
    """--chat-template NAME (llama-server's): a name that is no file but one of llama.cpp's
    built-in templates renders through it; any other name is one line saying what it takes."""
    process, url = start_server(
        # --chat-template-file: llama-server's spelling of the same option
        quill_home,
        tmp_path,
        str(tiny_models[0]),
        "--chat-template-file",
        "command-r",
        "--ctx",
        "256",
    )
    try:
        messages = [{"role": "system", "content": "You are a test."},
                    {"role": "user", "content": "Hi there"}]  # fmt: skip
        prompt = httpx.post(
            f"{url}/apply-template", json={"messages": messages}, timeout=30
        ).json()["prompt"]
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert prompt == (  # llama.cpp's own test's expectation for command-r
        "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
    )
    from typer.testing import CliRunner

    from cli.app import app

    result = CliRunner().invoke(
        app, ["run", "-m", str(tiny_models[0]), "hi", "--chat-template", "no-such-template"]
    )
    assert result.exit_code == 2
    assert "neither a file nor one of llama.cpp's built-in templates (chatml" in result.stderr


def test_input_tokens_counts_what_the_request_would_prefill(aliased: str) -> None:
    """OpenAI's POST /v1/responses/input_tokens and llama-server's
    /chat/completions/input_tokens: the prompt tokens, as the request itself would count them."""
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "best book"}]
    chat = httpx.post(
        f"{aliased}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}, timeout=60
    ).json()["usage"]["prompt_tokens"]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        counted = httpx.post(f"{aliased}{path}", json={"messages": messages}, timeout=30).json()
        assert counted["input_tokens"] == chat  # same path: one tokenizer's count
    body = {"input": "best book", "instructions": "Book"}
    made = httpx.post(
        f"{aliased}/v1/responses", json={**body, "max_output_tokens": 1}, timeout=60
    ).json()["usage"]["input_tokens"]
    counted = httpx.post(f"{aliased}/v1/responses/input_tokens", json=body, timeout=30).json()
    assert counted == {"object": "response.input_tokens", "input_tokens": made}
    refused = httpx.post(f"{aliased}/chat/completions/input_tokens", json={}, timeout=30)
    assert refused.status_code == 400 and "messages" in refused.json()["error"]["message"]


def test_continuing_the_last_assistant_message_is_refused_not_ignored(aliased: str) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    for fields in ({"continue_final_message": True}, {"add_generation_prompt": False},
                   {"continue_final_message": "yes"}):  # fmt: skip
        reply = httpx.post(
            f"{aliased}/v1/chat/completions", json={"messages": messages, **fields}, timeout=30
        )
        assert reply.status_code == 400, fields
        assert next(iter(fields)) in reply.json()["error"]["message"]
    plain = {"messages": messages, "add_generation_prompt": True, "max_tokens": 1}
    assert httpx.post(f"{aliased}/v1/chat/completions", json=plain, timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_each_their_own_sequence(aliased: str, stream: bool) -> None:
    """OpenAI's n: that many choices, each indexed, each with its own finish; seeded, choice i
    runs with seed + i; the prompt is counted once in usage and the completions summed."""
    client = openai.OpenAI(base_url=f"{aliased}/v1", api_key="none", max_retries=0)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "red"}], n=3, max_tokens=4,
               temperature=1.0, seed=11, extra_body={"ignore_eos": True})  # fmt: skip
    if not stream:
        reply = client.chat.completions.create(**ask)
        assert [choice.index for choice in reply.choices] == [0, 1, 2]
        assert all(choice.finish_reason == "length" for choice in reply.choices)
        assert reply.usage.completion_tokens == 12
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
        return
    texts, finishes, done = {}, {}, 0
    with httpx.stream(
        "POST", f"{aliased}/v1/chat/completions", timeout=60,
        json={**{k: v for k, v in ask.items() if k != "extra_body"}, "ignore_eos": True,
              "stream": True},
    ) as response:  # fmt: skip
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done += 1
                continue
            if not line.startswith("data: "):
                continue
            choice = json.loads(line[6:])["choices"][0]
            texts.setdefault(choice["index"], []).append(choice["delta"].get("content") or "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"} and done == 1
    assert sorted(texts) == [0, 1, 2]
    refused = client.chat.completions.with_raw_response
    with pytest.raises(openai.BadRequestError, match="'n' must be between 1 and 8"):
        refused.create(model="tiny", messages=[{"role": "user", "content": "red"}], n=9)


def test_include_usage_sends_usage_in_a_chunk_of_its_own(aliased: str) -> None:
    """stream_options.include_usage, as OpenAI sends it: after the last choice chunk, one with
    no choices and the usage (quill's timings beside it); without it, the usage rides on the
    last chunk, as quill always sent it."""

    def chunks(**extra) -> list[dict]:
        body = {"messages": [{"role": "user", "content": "red"}], "max_tokens": 3,
                "stream": True, **extra}  # fmt: skip
        with httpx.stream("POST", f"{aliased}/v1/chat/completions", json=body, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        return [json.loads(line[6:]) for line in lines]

    with_usage = chunks(stream_options={"include_usage": True})
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] <= 3
    assert "timings" in with_usage[-1]
    assert with_usage[-2]["choices"][0]["finish_reason"] and "usage" not in with_usage[-2]
    plain = chunks()
    assert plain[-1]["choices"][0]["finish_reason"] and "usage" in plain[-1]
    refused = httpx.post(
        f"{aliased}/v1/chat/completions", timeout=30,
        json={"messages": [{"role": "user", "content": "red"}], "stream_options": "yes"},
    )  # fmt: skip
    assert refused.status_code == 400 and "stream_options" in refused.json()["error"]["message"]


def test_a_schema_with_tuple_items_is_read_as_draft_7(aliased: str) -> None:
    """ "items": [schemas] (the tuple form of drafts 4 to 7; 2020-12 says prefixItems) is taken,
    as llama-server takes it: the reply is an array of one integer."""
    schema = {"items": [{"type": "integer"}]}
    body = {"messages": [{"role": "user", "content": "red"}], "max_tokens": 12,
            "response_format": {"type": "json_object", "schema": schema}}  # fmt: skip
    reply = httpx.post(f"{aliased}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    content = reply.json()["choices"][0]["message"]["content"]
    if reply.json()["choices"][0]["finish_reason"] == "stop":
        value = json.loads(content)
        assert isinstance(value, list) and len(value) == 1 and isinstance(value[0], int)
    else:  # cut by max_tokens: a prefix of such an array
        assert content.startswith("[")
    bad = {**body, "response_format": {"type": "json_object", "schema": {"items": 5}}}
    refused = httpx.post(f"{aliased}/v1/chat/completions", json=bad, timeout=60)
    assert refused.status_code == 400 and "not a valid JSON Schema" in refused.text

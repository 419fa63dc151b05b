"""Anthropic's Messages API on quill serve (cli/api/anthropic.py), through the official anthropic
SDK and raw HTTP where the SDK hides the wire: plain and streamed messages, tool use forced by
tool_choice (the grammar makes the tiny model write a valid call) and its result sent back,
stop sequences, max_tokens, thinking blocks from a reasoning template, count_tokens against the
prompt an Engine renders, the API key, and hostile bodies, each a 4xx in Anthropic's error shape.
One server serves two tiny models: Qwen2.5's template (tools) and DeepSeek-R1's (thinking)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx2 as httpx  # the anthropic client is built on httpx2
import pytest

from cli.api.anthropic import AnthropicReply
from cli.api.replies import ChatReply
from cli.api.server import ServedRequest
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions

from conftest import KEY, raw_exchange, start_server
from tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
QWEN, R1 = "Qwen-Qwen2.5-7B-Instruct", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
CITIES, ZONES = ["Paris", "Rome", "Lima"], ["UTC", "CET"]
TOOLS = [
    {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": CITIES}},
            "required": ["city"],
        },
    },
    {
        "name": "get_time",
        "description": "The time now in a time zone.",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ZONES}},
            "required": ["zone"],
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("anthropic-models")
    made = {}
    for name in (QWEN, R1):
        source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        made[name] = write_tiny_llama(folder / f"{name}.gguf", n_layer=1, chat_template=source)
    return made


@pytest.fixture(scope="module")
def server(models: dict[str, Path], quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve-anthropic"),
        str(models[QWEN]), str(models[R1]),
        "--parallel", "2", "--ctx", "1024", "--api-key", KEY, "--body-timeout", "1",
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert "Traceback" not in process.stderr.read()


@pytest.fixture(scope="module")
def client(server: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


def post(server: str, body: bytes | dict, path: str = "/v1/messages", key: str = KEY):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"x-api-key": key, "Content-Type": "application/json"}
    return httpx.post(f"{server}{path}", content=content, headers=headers, timeout=60)


def events_of(server: str, body: dict) -> list[tuple[str, dict]]:
    """The (event, data) frames of a streamed reply, as sent."""
    with httpx.stream(
        "POST", f"{server}/v1/messages", json={**body, "stream": True},
        headers={"x-api-key": KEY}, timeout=60,
    ) as response:  # fmt: skip
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/event-stream"
        text = response.read().decode()
    frames = []
    for frame in text.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
        frames.append((name_line.removeprefix("event: "), json.loads(data_line[6:])))
    return frames


def openai_tools() -> list[dict]:
    return [
        {"type": "function", "function": {"name": t["name"], "description": t["description"],
                                          "parameters": t["input_schema"]}}
        for t in TOOLS
    ]  # fmt: skip


def prompt_tokens(path: Path, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The tokens of the prompt an Engine renders for OpenAI-style messages."""
    with Engine(path, LoadOptions(n_ctx=1024, threads=1)) as engine:
        return len(engine.tokenize(engine.chat_prompt(messages, tools=tools)))


def test_a_message_is_anthropics_shape_and_stops_at_max_tokens(client, models) -> None:
    reply = client.messages.create(
        model=str(models[QWEN]),
        max_tokens=3,
        messages=ASK,
        extra_body={"temperature": 0},  # this SDK has no temperature argument
        metadata={"user_id": "u"},
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert reply.model == str(models[QWEN])
    (block,) = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 3 and reply.usage.cache_creation_input_tokens == 0
    total = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert total == prompt_tokens(models[QWEN], ASK)


def test_an_agents_max_tokens_past_the_servers_limit_is_bounded_by_it(server, models) -> None:
    """Claude Code asks for 32,000 tokens and more; the server's own bound (here its 1024-token
    context) holds instead of a 400 the agent could not get past."""
    body = {"model": str(models[QWEN]), "max_tokens": 64000, "messages": ASK,
            "temperature": 0}  # fmt: skip
    reply = post(server, body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["output_tokens"] <= 1024 - prompt
    refused = post(server, {**body, "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_count_tokens_is_the_prompt_the_message_prefilled(client, models) -> None:
    """count_tokens, the usage of the same request (uncached plus cache read, as Anthropic
    counts) and the prompt an Engine renders agree; a system of text blocks is their text."""
    model = str(models[QWEN])
    system = "Be brief. Answer in French."
    counted = client.messages.count_tokens(model=model, messages=ASK, system=system)
    blocks = [{"type": "text", "text": "Be brief. "}, {"type": "text", "text": "Answer in French."}]
    as_blocks = client.messages.count_tokens(model=model, messages=ASK, system=blocks)
    expected = prompt_tokens(models[QWEN], [{"role": "system", "content": system}, *ASK])
    # same path: counts of one tokenizer's tokens, no text generated
    assert counted.input_tokens == as_blocks.input_tokens == expected
    reply = client.messages.create(model=model, max_tokens=2, messages=ASK, system=system)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == expected
    assert reply.usage.input_tokens < expected  # the second time the cache holds most of it


def test_a_stream_is_anthropics_event_sequence_and_the_sdk_accumulates_it(
    client, server, models
) -> None:
    model = str(models[QWEN])
    with client.messages.stream(model=model, max_tokens=5, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    # same path: one reply, as streamed pieces and as the SDK's accumulated message
    assert final.content[0].type == "text" and final.content[0].text == text and text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 5
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt_tokens(
        models[QWEN], ASK
    )

    frames = events_of(server, {"model": model, "max_tokens": 4, "messages": ASK})
    names = [name for name, _ in frames]
    assert all(name == data["type"] for name, data in frames)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = frames[0][1]["message"]
    assert (
        start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"]
    )
    assert frames[2][1] == {"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}  # fmt: skip
    assert all(data["index"] == 0 for _, data in frames[3:-2])
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_stop_sequences_end_the_reply_and_are_named(client, server, models) -> None:
    """Common letters as stop sequences: the tiny model writes one within a few tokens."""
    stops = [" ", "e", "a", "t", "o", "i", "n", "s"]
    ask = {"model": str(models[QWEN]), "max_tokens": 30, "messages": ASK, "stop_sequences": stops}
    reply = client.messages.create(**ask)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence in stops
    text = "".join(block.text for block in reply.content)
    assert not any(stop in text for stop in stops)
    delta = events_of(server, ask)[-2][1]["delta"]
    assert delta["stop_reason"] == "stop_sequence" and delta["stop_sequence"] in stops


def _valid_input(block) -> bool:
    if block.name == "get_weather":
        return block.input in ({"city": city} for city in CITIES)
    return block.name == "get_time" and block.input in ({"zone": zone} for zone in ZONES)


def test_a_tool_use_round_trip(client, models) -> None:
    """tool_choice any: a tool_use block whose input follows the schema, stop_reason tool_use;
    the tool_result sent back is rendered into the prompt, as the template writes a tool
    message answering that call."""
    model = str(models[QWEN])
    first = client.messages.create(
        model=model, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice={"type": "any"},
        extra_body={"temperature": 1.0},
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert call.type == "tool_use" and call.id.startswith("toolu_") and _valid_input(call)
    back = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}
        ]},
    ]  # fmt: skip
    answer = client.messages.create(model=model, max_tokens=3, messages=back, tools=TOOLS)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    counted = client.messages.count_tokens(model=model, messages=back, tools=TOOLS).input_tokens
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == counted
    as_openai = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.input}}
        ]},
        {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": "sunny, 21 C"},
    ]  # fmt: skip
    with Engine(models[QWEN], LoadOptions(n_ctx=1024, threads=1)) as engine:
        prompt = engine.chat_prompt(as_openai, tools=openai_tools())
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
        assert json.dumps(call.input) in prompt  # the call, as the template writes it
        assert counted == len(engine.tokenize(prompt))


def test_tool_choice_tool_calls_the_named_one_streamed_too(client, server, models) -> None:
    named = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    ask = {"model": str(models[QWEN]), "max_tokens": 120, "messages": ASK, "tools": TOOLS,
           "tool_choice": named}  # fmt: skip
    whole = client.messages.create(**ask)
    assert [b.name for b in whole.content if b.type == "tool_use"] == ["get_time"]
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert call.name == "get_time" and _valid_input(call) and final.stop_reason == "tool_use"
    frames = events_of(server, ask)
    starts = [d["content_block"] for n, d in frames if n == "content_block_start"]
    assert starts[-1]["type"] == "tool_use" and starts[-1]["input"] == {}
    deltas = [data["delta"] for name, data in frames if name == "content_block_delta"]
    (json_delta,) = [delta for delta in deltas if delta["type"] == "input_json_delta"]
    assert json.loads(json_delta["partial_json"])["zone"] in ZONES


def test_tool_choice_none_leaves_the_tools_out_and_auto_lets_the_model_decide(
    client, models
) -> None:
    model = str(models[QWEN])

    def count(choice: dict) -> int:
        asked = client.messages.count_tokens(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice
        )
        return asked.input_tokens

    none, auto, any_ = count({"type": "none"}), count({"type": "auto"}), count({"type": "any"})
    assert none == prompt_tokens(models[QWEN], ASK) < auto == any_
    assert auto == prompt_tokens(models[QWEN], ASK, openai_tools())
    reply = client.messages.create(
        model=model, max_tokens=8, messages=ASK, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert reply.stop_reason != "tool_use" and all(b.type == "text" for b in reply.content)
    free = client.messages.create(
        model=model, max_tokens=8, messages=ASK, tools=TOOLS, tool_choice={"type": "auto"}
    )
    assert free.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_thinking_blocks_from_a_reasoning_template(client, server, models) -> None:
    """DeepSeek-R1's template opens <think> unless thinking is disabled: what the model writes
    is then a thinking block (signed with an empty signature), streamed as thinking_delta."""
    model = str(models[R1])
    on = {"type": "enabled", "budget_tokens": 1024}
    reply = client.messages.create(model=model, max_tokens=6, messages=ASK, thinking=on)
    block = reply.content[0]
    assert block.type == "thinking" and block.thinking and block.signature == ""
    with client.messages.stream(model=model, max_tokens=6, messages=ASK, thinking=on) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking
    frames = events_of(server, {"model": model, "max_tokens": 4, "messages": ASK, "thinking": on})
    kinds = [data["delta"]["type"] for name, data in frames if name == "content_block_delta"]
    assert kinds[0] == "thinking_delta" and kinds[-1] == "signature_delta"
    assert [n for n, _ in frames].index("content_block_stop") == len(kinds) + 3  # after signature
    off = client.messages.create(
        model=model, max_tokens=6, messages=ASK, thinking={"type": "disabled"}
    )
    assert [b.type for b in off.content] == ["text"]
    # An earlier turn's thinking goes to the template as its reasoning; redacted thinking (its
    # data Anthropic's encryption) is dropped.
    said = [
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "thinking", "thinking": "Hmm.", "signature": "s"},
        {"type": "text", "text": "Sunny."},
    ]
    history = [*ASK, {"role": "assistant", "content": said}, {"role": "user", "content": "ok"}]
    counted = client.messages.count_tokens(model=model, messages=history).input_tokens
    turn = {"role": "assistant", "content": "Sunny.", "reasoning_content": "Hmm."}
    assert counted == prompt_tokens(models[R1], [*ASK, turn, history[-1]])


def test_the_api_key_is_read_from_x_api_key_and_a_wrong_one_is_anthropics_401(
    server, models
) -> None:
    body = {"model": str(models[QWEN]), "max_tokens": 1, "messages": ASK}
    assert post(server, body).status_code == 200
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = post(server, body, path, key="wrong")
        assert refused.status_code == 401
        error = refused.json()
        assert error["type"] == "error" and error["error"]["type"] == "authentication_error"
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=str(models[QWEN]), max_tokens=1, messages=ASK)


RESULT_FOR_NOTHING = [
    *ASK,
    {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
    },
]
BAD_TOOL = {"name": "a b", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": NaN}', "NaN"),
        ({"messages": ASK}, "'max_tokens' is required"),
        ({"messages": ASK, "max_tokens": "10"}, "'max_tokens' must be a number"),
        ({"messages": ASK, "max_tokens": 0}, "'max_tokens' must be between 1"),
        ({"messages": {"role": "user"}, "max_tokens": 4}, "'messages' must be a non-empty array"),
        ({"messages": [], "max_tokens": 4}, "'messages' must be a non-empty array"),
        ({"messages": ["hi"], "max_tokens": 4}, "messages[0] must be an object"),
        ({"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}], "max_tokens": 4},
         "messages[0].content must be a string or an array"),
        ({"messages": [{"role": "user", "content": [{"text": "hi"}]}], "max_tokens": 4},
         "messages[0].content[0] must be a content block"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}],
          "max_tokens": 4}, "messages[0].content[0].text must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "hologram"}]}], "max_tokens": 4},
         'messages[0].content[0] is a "hologram" block'),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
          "max_tokens": 4}, '"image" block'),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b",
          "input": {}}]}], "max_tokens": 4}, "user content holds text, tool_result blocks only"),
        ({"messages": RESULT_FOR_NOTHING, "max_tokens": 4}, "answers no tool_use block"),
        ({"messages": [*ASK, {"role": "assistant", "content": "The"}], "max_tokens": 4},
         "end with a user message"),
        ({"messages": ASK, "max_tokens": 4, "temperature": 5}, "between 0 and 1"),
        ({"messages": ASK, "max_tokens": 4, "top_k": "5"}, "'top_k' must be a number"),
        ({"messages": ASK, "max_tokens": 4, "stream": "yes"}, "'stream' must be true or false"),
        ({"messages": ASK, "max_tokens": 4, "system": 7}, "'system' must be a string"),
        ({"messages": ASK, "max_tokens": 4, "metadata": "x"}, "'metadata' must be an object"),
        ({"messages": ASK, "max_tokens": 4, "stop_sequences": "END"}, "'stop_sequences' must be"),
        ({"messages": ASK, "max_tokens": 4, "stop_sequences": [f"s{i}" for i in range(1000)]},
         "'stop_sequences' has 1000 strings"),
        ({"messages": ASK, "max_tokens": 4, "tools": {"name": "x"}}, "'tools' must be an array"),
        ({"messages": ASK, "max_tokens": 4, "tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"messages": ASK, "max_tokens": 4, "tools": [BAD_TOOL]}, "tools[0].name must be 1 to"),
        ({"messages": ASK, "max_tokens": 4, "tools": [{"type": "web_search_20250305",
          "name": "web_search"}]}, "quill runs none"),
        ({"messages": ASK, "max_tokens": 4, "tools": TOOLS, "tool_choice": "any"},
         "'tool_choice' must be"),
        ({"messages": ASK, "max_tokens": 4, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "names 'nope'"),
        ({"messages": ASK, "max_tokens": 4, "tool_choice": {"type": "any"}}, "needs 'tools'"),
        ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "on"}}, "'thinking' must be"),
        ({"messages": ASK, "max_tokens": 4, "thinking": {"type": "enabled"}}, "budget_tokens"),
        (b'{"messages": [{"role": "user", "content": "a \\ud800"}], "max_tokens": 4}',
         "lone surrogate"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}] * 3000}],
          "max_tokens": 4}, "context holds 1024 tokens"),
    ],
)  # fmt: skip
def test_hostile_bodies_are_400s_in_anthropics_shape(server, models, body, needle) -> None:
    if isinstance(body, dict):
        body = {"model": str(models[QWEN]), **body}
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert needle in error["error"]["message"], error
    if isinstance(body, dict) and "max_tokens" in body:  # count_tokens reads the same prompt
        counted = post(server, body, "/v1/messages/count_tokens")
        assert counted.status_code in (200, 400) and "Traceback" not in counted.text
    ok = {"model": str(models[QWEN]), "messages": ASK}
    assert post(server, ok, "/v1/messages/count_tokens").status_code == 200  # still answering


def status_and_error(server: str, request: bytes) -> tuple[bytes, dict]:
    """The status line and JSON body the server answers raw bytes with."""
    head, _, body = raw_exchange(server, request).partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], json.loads(body)


HEAD = b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nx-api-key: " + KEY.encode() + b"\r\n"


def test_a_body_over_the_limit_is_anthropics_413_before_it_is_read(server) -> None:
    status, error = status_and_error(server, HEAD + b"Content-Length: 5000000\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413")
    assert error["type"] == "error" and error["error"]["type"] == "request_too_large"
    assert post(server, {"messages": ASK}, "/v1/messages/count_tokens").status_code == 200


def test_a_content_length_that_lies_times_out_in_anthropics_shape(server) -> None:
    status, error = status_and_error(server, HEAD + b'Content-Length: 100\r\n\r\n{"messages"')
    assert status.startswith(b"HTTP/1.1 408")  # --body-timeout 1
    assert error["type"] == "error" and "did not all arrive" in error["error"]["message"]
    assert post(server, {"messages": ASK}, "/v1/messages/count_tokens").status_code == 200


def test_a_failure_mid_stream_is_an_anthropic_error_event() -> None:
    """The drain's 503 (and any failure after the stream began) reaches the SDK as Anthropic's
    error event, which it raises."""
    served = ServedRequest([1, 2, 3], 4, reply=ChatReply("prompt", None, "hermes"))
    reply = AnthropicReply("msg_x", "tiny", served)
    body = {"error": {"message": "the server shut down", "type": "server_error",
                      "param": None, "code": "server_shutting_down"}}  # fmt: skip
    frame = reply.failure(body).decode()
    name, data = frame.strip().split("\n")
    assert name == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the server shut down"},
    }
    failed = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert json.loads(reply.failure(failed).decode().split("data: ")[1])["error"]["type"] == (
        "api_error"
    )


def test_malformed_framing_is_anthropics_400_too(server, models) -> None:
    """A negative or doubled Content-Length is refused by the HTTP layer before any route runs:
    still in the shape of the API the request line named."""
    for framing in (
        b"Content-Length: -5\r\n\r\n",
        b"Content-Length: 5\r\nContent-Length: 6\r\n\r\n",
    ):
        status, error = status_and_error(server, HEAD + framing)
        assert status.startswith(b"HTTP/1.1 400"), status
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    reply = post(server, {"model": str(models[QWEN]), "max_tokens": 1, "messages": ASK})
    assert reply.status_code == 200  # and the server answers on

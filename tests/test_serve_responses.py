"""OpenAI's Responses API on quill serve (cli/api/responses.py), driven by the official openai
client and by raw HTTP: whole and streamed responses, function calls and their outputs sent
back, previous_response_id and the prefix cache it lets reuse, the store (GET, DELETE, store
false, its bound), structured output, max_output_tokens, and bodies a hostile client sends.

Fast tier: the tiny random model with real chat templates writes gibberish, so function calls are
forced (tool_choice required or named: the grammar makes it write a valid call) and structured
output is asked for with a schema (the grammar makes the reply parse)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import httpx2 as httpx  # the openai client is built on httpx2
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from cli.api.replies import ChatReply
from cli.api.responses import ResponsesRequest, ResponseStore, ResponseWriter, echoed_settings
from cli.engine.events import StreamEvent

from conftest import raw_exchange, start_server
from tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
CITIES = ["Paris", "Rome", "Lima"]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": CITIES}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time now in a time zone.",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}
# Small replies keep the file fast; a seed keeps each the same from run to run.
SMALL = {"model": "quill", "max_output_tokens": 8, "extra_body": {"seed": 3}}


def _server(model: Path, folder: Path, quill_home: Path) -> Iterator[str]:
    process, url = start_server(
        quill_home, folder, str(model), "--parallel", "2", "--ctx", "1024", "--body-timeout", "1"
    )
    yield url
    process.terminate()
    process.wait(timeout=30)
    assert "Traceback" not in process.stderr.read()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, quill_home: Path) -> Iterator[str]:
    """Qwen2.5's template: tools, in Hermes' <tool_call> format."""
    folder = tmp_path_factory.mktemp("responses")
    source = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text("utf-8")
    model = write_tiny_llama(folder / "qwen25.gguf", n_layer=1, chat_template=source)
    yield from _server(model, folder, quill_home)


@pytest.fixture(scope="module")
def r1_server(tmp_path_factory: pytest.TempPathFactory, quill_home: Path) -> Iterator[str]:
    """DeepSeek-R1-Distill's template: the prompt ends inside an open <think> block, so all the
    tiny model writes is reasoning."""
    folder = tmp_path_factory.mktemp("responses-r1")
    source = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text("utf-8")
    model = write_tiny_llama(folder / "r1.gguf", n_layer=1, chat_template=source)
    yield from _server(model, folder, quill_home)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def post(url: str, body: bytes | dict, **kwargs) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{url}/v1/responses", content=content, headers=headers, timeout=60, **kwargs)


# The SDK's model of each stream event, by its type.
STREAM_EVENTS = {
    get_args(model.model_fields["type"].annotation)[0]: model
    for model in get_args(get_args(ResponseStreamEvent)[0])
}


def events_of(text: str) -> list[tuple[str, dict]]:
    """A stream's Server-Sent Events: (event name, its data), each event checked against the
    SDK's model of it (every field it requires, of its type), numbered in order."""
    found = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        STREAM_EVENTS[data["type"]].model_validate(data)
        assert data["type"] == lines["event"] and data["sequence_number"] == len(found)
        found.append((lines["event"], data))
    return found


def message_text(response: dict) -> str:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    return "".join(part["text"] for part in message["content"])


# --- whole and streamed ---------------------------------------------------------------------------


def test_a_string_input_with_instructions(client: openai.OpenAI, server: str) -> None:
    response = client.responses.create(input="Tell me a story.", instructions="Be brief.", **SMALL)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete"  # 8 tokens of gibberish: cut at max_output_tokens
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and response.output_text
    usage = response.usage
    assert usage is not None and usage.output_tokens == 8 and usage.input_tokens > 10
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    # every field the SDK's model declares is there, of its type
    raw = httpx.get(f"{server}/v1/responses/{response.id}", timeout=10).json()
    Response.model_validate(raw)
    # same path: one response, as created and as stored
    assert message_text(raw) == response.output_text


def test_the_sdk_streams_a_response_and_the_events_come_in_order(
    client: openai.OpenAI, server: str
) -> None:
    with client.responses.stream(input="Tell me a story.", **SMALL) as stream:
        seen = list(stream)
    deltas = [event.delta for event in seen if event.type == "response.output_text.delta"]
    assert deltas and seen[-1].type == "response.incomplete"

    body = {"model": "quill", "input": "Tell me a story.", "max_output_tokens": 8, "seed": 3,
            "stream": True}  # fmt: skip
    reply = post(server, body)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = events_of(reply.text)
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    texts = names[4:-4]
    assert names[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert texts and set(texts) == {"response.output_text.delta"}
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1][1]["response"]
    streamed = "".join(data["delta"] for name, data in events if name.endswith("text.delta"))
    # same path: one reply, as its deltas, its done event and its final response
    assert message_text(final) == streamed == events[-4][1]["text"]
    assert events[0][1]["response"]["id"] == final["id"] and final["status"] == "incomplete"
    stored = httpx.get(f"{server}/v1/responses/{final['id']}", timeout=10).json()
    assert stored == final  # kept once the stream finished
    assert "".join(deltas) and streamed  # the SDK's stream carries text too
    whole = client.responses.create(input="Tell me a story.", **SMALL)
    # (whole and streamed replies are two compute paths, the second on the first's prefix cache:
    # near-tied picks may differ, so only the shape is compared)
    assert whole.output_text and whole.status == "incomplete"


def test_a_completed_stream_gives_the_sdk_its_final_response(client: openai.OpenAI) -> None:
    """Structured output ends when the schema's JSON is complete: response.completed."""
    text = {"format": {"type": "json_schema", "name": "point", "schema": POINT, "strict": True}}
    ask = {**SMALL, "max_output_tokens": 60}
    with client.responses.stream(input="A point.", text=text, **ask) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert names[-1] == "response.completed" and final.status == "completed"
    assert set(json.loads(final.output_text)) == {"x", "ok"}

    created = client.responses.create(input="A point.", text=text, stream=True, **ask)
    kinds = [event.type for event in created]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


# --- function calls, continuation, the prefix cache -----------------------------------------------


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    asked = client.responses.create(
        input="What is the weather in Paris?",
        tools=[WEATHER, TIME],
        tool_choice="required",
        **{**SMALL, "max_output_tokens": 60},
    )
    assert asked.status == "completed"
    (call,) = [item for item in asked.output if item.type == "function_call"]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name in ("get_weather", "get_time") and call.status == "completed"
    arguments = json.loads(call.arguments)
    assert arguments in [{"city": c} for c in CITIES] or arguments in [
        {"zone": "UTC"},
        {"zone": "CET"},
    ]

    answered = client.responses.create(
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER, TIME],
        **SMALL,
    )
    assert answered.previous_response_id == asked.id
    assert [item.type for item in answered.output] == ["message"]
    assert answered.usage is not None and asked.usage is not None
    # the first prompt, the call, then the output: the call's prompt was reused
    assert answered.usage.input_tokens_details.cached_tokens >= asked.usage.input_tokens


def test_tools_the_server_would_run_are_left_out_as_agents_send_them(
    client: openai.OpenAI, server: str
) -> None:
    """Codex CLI sends web_search and a namespace of sub-agent tools on every request: quill
    runs neither, so neither is offered to the model (the prompt is as without them), and the
    function tools beside them are called as ever."""
    hosted = [{"type": "web_search", "external_web_access": False},
              {"type": "namespace", "name": "agents", "tools": [TIME]}]  # fmt: skip
    bare = client.responses.create(input="The time?", **SMALL)
    only_hosted = client.responses.create(input="The time?", tools=hosted, **SMALL)
    # same path: prompt token counts of one tokenizer; nothing generated is compared
    assert only_hosted.usage.input_tokens == bare.usage.input_tokens
    forced = client.responses.create(
        input="The time?", tools=[*hosted, WEATHER], tool_choice="required",
        **{**SMALL, "max_output_tokens": 60},
    )  # fmt: skip
    (call,) = forced.output
    assert call.type == "function_call" and call.name == "get_weather"


def test_a_named_function_is_called_whole_and_streamed(client: openai.OpenAI, server: str) -> None:
    ask = {"input": "The time?", "tools": [WEATHER, TIME],
           "tool_choice": {"type": "function", "name": "get_time"},
           **{**SMALL, "max_output_tokens": 60}}  # fmt: skip
    whole = client.responses.create(**ask)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_time"
    assert json.loads(call.arguments)["zone"] in ("UTC", "CET")
    with client.responses.stream(**ask) as stream:
        names = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in names
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments

    raw = {key: value for key, value in ask.items() if key != "extra_body"}
    events = events_of(post(server, {**raw, "seed": 3, "stream": True}).text)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[4][1]["arguments"] == call.arguments


def test_a_continuation_reuses_the_previous_prompt_from_the_cache(client: openai.OpenAI) -> None:
    """The acceptance line: the second call's cached tokens cover the first call's prompt."""
    first = client.responses.create(input="Tell me about the river.", instructions="Be brief.",
                                    **SMALL)  # fmt: skip
    second = client.responses.create(
        input="And the bridge?", instructions="Be brief.", previous_response_id=first.id, **SMALL
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # the instructions are this request's only: a continuation without them has none
    third = client.responses.create(input="More.", previous_response_id=second.id, **SMALL)
    assert third.instructions is None


def test_a_conversation_sent_whole_as_items(client: openai.OpenAI) -> None:
    """No previous_response_id: the client sends the history itself, the call and its output
    included, with content as parts."""
    history = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Rainy"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
        {"role": "user", "content": "And in Lima?"},
    ]  # fmt: skip
    response = client.responses.create(input=history, tools=[WEATHER], **SMALL)
    assert response.output[0].type == "message" and response.usage is not None
    alone = client.responses.create(input="And in Lima?", tools=[WEATHER], **SMALL)
    assert alone.usage is not None
    assert response.usage.input_tokens > alone.usage.input_tokens + 10  # the history is in it


def test_reasoning_is_its_own_item_whole_and_streamed(r1_server: str) -> None:
    client = openai.OpenAI(base_url=f"{r1_server}/v1", api_key="none", max_retries=0)
    think = {"reasoning": {"effort": "low"}, **SMALL}
    whole = client.responses.create(input="Why?", **think)
    reasoning, *rest = whole.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and not rest
    assert reasoning.content is not None and reasoning.content[0].text
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 8
    assert whole.output_text == ""

    body = {"model": "quill", "input": "Why?", "max_output_tokens": 8, "seed": 3, "stream": True,
            "reasoning": {"effort": "low"}}  # fmt: skip
    events = events_of(post(r1_server, body).text)
    names = [name for name, _ in events]
    assert names[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.reasoning_text.delta" in names and "response.output_text.delta" not in names
    done = next(data for name, data in events if name == "response.reasoning_text.done")
    streamed = "".join(d["delta"] for name, d in events if name == "response.reasoning_text.delta")
    # same path: one stream's reasoning, as its deltas and as its done event
    assert done["text"] == streamed and reasoning.content[0].text
    with client.responses.stream(input="Why?", **think) as stream:
        assert [event.type for event in stream][-1] == "response.incomplete"
    # effort "none": the template closes the block itself, and nothing is reasoning
    off = client.responses.create(input="Why?", reasoning={"effort": "none"}, **SMALL)
    assert [item.type for item in off.output] == ["message"] and off.output_text
    assert off.usage is not None and off.usage.output_tokens_details.reasoning_tokens == 0


# --- the store ------------------------------------------------------------------------------------


def test_get_and_delete_a_stored_response(client: openai.OpenAI, server: str) -> None:
    made = client.responses.create(input="hello", metadata={"who": "test"}, **SMALL)
    got = client.responses.retrieve(made.id)
    # same path: one response, as created and as stored
    assert got.id == made.id and got.output_text == made.output_text
    assert got.metadata == {"who": "test"} and got.store is True
    client.responses.delete(made.id)
    gone = httpx.get(f"{server}/v1/responses/{made.id}", timeout=10)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    again = httpx.delete(f"{server}/v1/responses/{made.id}", timeout=10)
    assert again.status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="more", previous_response_id=made.id, **SMALL)
    assert refused.value.code == "previous_response_not_found"


def test_store_false_keeps_nothing(client: openai.OpenAI, server: str) -> None:
    made = client.responses.create(input="hello", store=False, **SMALL)
    assert made.store is False and made.output_text
    assert httpx.get(f"{server}/v1/responses/{made.id}", timeout=10).status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="more", previous_response_id=made.id, **SMALL)
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_the_store_keeps_the_most_recently_used_within_its_bounds() -> None:
    store = ResponseStore(max_count=3, max_bytes=10_000)
    for number in range(5):
        store.put({"id": f"resp_{number}", "output": []}, [{"n": number}])
    assert len(store) == 3 and store.retrieve("resp_0") is None and store.retrieve("resp_1") is None
    assert store.continuation("resp_2") == [{"n": 2}]  # used: now the most recent
    store.put({"id": "resp_5", "output": []}, [])
    assert store.retrieve("resp_3") is None and store.retrieve("resp_2") is not None
    # the size bound: a large record pushes out the older ones, and stays itself
    store.put({"id": "resp_big", "output": ["x" * 9_950]}, [])
    assert store.retrieve("resp_big") is not None and len(store) == 1
    store.put({"id": "resp_huge", "output": ["x" * 20_000]}, [])
    assert len(store) == 1 and store.retrieve("resp_huge") is not None
    assert store.delete("resp_huge") and not store.delete("resp_huge") and len(store) == 0
    # what a caller does with a retrieved response does not change the stored one
    store.put({"id": "resp_6", "output": []}, [])
    store.retrieve("resp_6")["output"].append("changed")  # type: ignore[index]
    assert store.retrieve("resp_6") == {"id": "resp_6", "output": []}


def test_the_store_is_safe_across_threads() -> None:
    import threading

    store = ResponseStore(max_count=50, max_bytes=1 << 20)

    def work(worker: int) -> None:
        for number in range(200):
            ident = f"resp_{worker}_{number}"
            store.put({"id": ident, "output": [number]}, [{"n": number}])
            store.retrieve(ident)
            if number % 3 == 0:
                store.delete(f"resp_{worker}_{number - 1}")

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(store) == 50
    kept = [ident for ident in list(store._records) if store.retrieve(ident) is not None]
    assert len(kept) == 50
    assert store._bytes == sum(
        len(r.response) + len(r.continuation) for r in store._records.values()
    )


# --- structured output ----------------------------------------------------------------------------


def test_text_format_json_schema_and_the_sdks_parse(client: openai.OpenAI) -> None:
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        ok: bool

    parsed = client.responses.parse(input="A point.", text_format=Point,
                                    **{**SMALL, "max_output_tokens": 60})  # fmt: skip
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Point)
    assert parsed.text.format.type == "json_schema"  # type: ignore[union-attr]

    as_object = client.responses.create(
        input="Some JSON.",
        text={"format": {"type": "json_object"}},
        **{**SMALL, "max_output_tokens": 60},
    )
    # the grammar holds the reply to a JSON object from its first character
    assert as_object.output_text.lstrip().startswith("{")
    if as_object.status == "completed":
        assert isinstance(json.loads(as_object.output_text), dict)


# --- hostile bodies -------------------------------------------------------------------------------

HI = {"model": "quill", "input": "hi", "max_output_tokens": 2}


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({**HI, "input": 5}, "input", "'input' must be a string or an array"),
        ({**HI, "input": None}, "input", "'input' must be a string or an array"),
        ({**HI, "input": []}, "input", "'input' is empty"),
        ({**HI, "max_output_tokens": "5"}, "max_output_tokens", "'max_output_tokens' must be"),
        ({**HI, "max_output_tokens": 0}, "max_output_tokens", "'max_output_tokens' must be"),
        ({**HI, "temperature": "hot"}, "temperature", "'temperature' must be a number"),
        ({**HI, "tools": {"type": "function", "name": "f"}}, "tools", "'tools' must be an array"),
        ({**HI, "tools": [{"name": "get_weather"}]}, "tools", "tools[0] must be an object"),
        ({**HI, "tools": [{"type": "function", "name": "a b"}]}, "tools", "tools[0].name"),
        ({**HI, "tools": [WEATHER], "tool_choice": 5}, "tool_choice", "'tool_choice' must be"),
        ({**HI, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice", "not one of the tools"),
        ({**HI, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({**HI, "text": "json"}, "text", "'text' must be an object"),
        ({**HI, "text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
        ({**HI, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
         "needs a 'schema'"),
        ({**HI, "store": "yes"}, "store", "'store' must be true or false"),
        ({**HI, "instructions": 5}, "instructions", "'instructions' must be a string"),
        ({**HI, "metadata": [1]}, "metadata", "'metadata' must be an object"),
        ({**HI, "metadata": {"k": 1}}, "metadata", "string value"),
        ({**HI, "stream": "yes"}, "stream", "'stream' must be true or false"),
        ({**HI, "background": True}, "background", "not supported"),
        ({**HI, "reasoning": "high"}, "reasoning", "'reasoning' must be an object"),
        ({**HI, "reasoning": {"effort": "max"}}, "reasoning", "'reasoning.effort' must be"),
        ({**HI, "previous_response_id": 7}, "previous_response_id", "must be a string"),
        ({**HI, "previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
        ({**HI, "input": [{"type": "item_reference", "id": "msg_1"}]}, "input",
         '"item_reference"'),
        ({**HI, "input": [{"type": "bogus"}]}, "input", "input[0] has type \"bogus\""),
        ({**HI, "input": [5]}, "input", "input[0] must be an object"),
        ({**HI, "input": [{"role": "wizard", "content": "hi"}]}, "input", "input[0].role"),
        ({**HI, "input": [{"role": "user", "content": 5}]}, "input", "input[0].content"),
        ({**HI, "input": [{"role": "user", "content": [{"type": "input_image",
                                                        "image_url": "x"}]}]},
         "input", "text only"),
        ({**HI, "input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
         "input", "no function_call before it has"),
        ({**HI, "input": [{"type": "function_call", "call_id": 1, "name": "f",
                           "arguments": "{}"}]}, "input", "input[0].call_id must be a string"),
        ({**HI, "input": "a \ud800 b"}, "input", "lone surrogate"),
        ({**HI, "input": [{"role": "user", "content": "hi"}] * 5000}, "input", "at most 4096"),
        ({**HI, "input": "word " * 3000}, "input", "context"),
    ],
)  # fmt: skip
def test_hostile_bodies_are_400s_naming_the_field(server: str, body, param, needle) -> None:
    reply = post(server, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    # OpenAI's fields; a prompt past the context adds llama-server's n_prompt_tokens and n_ctx
    assert {"message", "type", "param", "code"} <= set(error) <= {
        "message", "type", "param", "code", "n_prompt_tokens", "n_ctx"
    }  # fmt: skip
    kinds = ("invalid_request_error", "exceed_context_size_error")  # the second: llama-server's
    assert error["type"] in kinds and error["param"] == param
    assert needle in error["message"], error["message"]
    assert post(server, HI).status_code == 200  # and the server goes on


def test_a_body_that_is_not_json_is_a_400(server: str) -> None:
    for raw in (b"{not json", b"[1, 2]", b'{"input": NaN}', b"\xff\xfe"):
        reply = post(server, raw)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert post(server, HI).status_code == 200


def test_a_lying_content_length_is_refused(server: str) -> None:
    body = json.dumps(HI).encode()
    head = b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    # more bytes promised than sent: the body never all arrives (--body-timeout 1)
    longer = raw_exchange(server, head + b"Content-Length: %d\r\n\r\n" % (len(body) + 50) + body)
    assert longer.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in longer
    # fewer promised than sent: the body is cut short, not JSON; the rest is no second request
    shorter = raw_exchange(server, head + b"Content-Length: 10\r\n\r\n" + body, wait_s=0.5)
    assert shorter.startswith(b"HTTP/1.1 400") and b"not valid JSON" in shorter
    assert shorter.count(b"HTTP/1.1 200") == 0
    assert post(server, HI).status_code == 200


def test_a_stream_that_fails_ends_with_an_error_event_and_response_failed() -> None:
    """What cli/api/http.py sends when a stream fails after it began (a drain, a failing
    request): the events the SDK knows, the text so far kept in the failed response."""
    reply = ChatReply("user: hi\nassistant:", None, "json")
    request = ResponsesRequest([1, 2], 8, reply=reply, echo=echoed_settings({}, None))
    writer = ResponseWriter(ResponseStore(), request, "tiny")
    step = StreamEvent("Hel", 5, 2, 0, 0.0, 1, 0.0, None, None, 0, 0)
    frames = [*writer.opening(), *writer.frames(step, 0.0)]
    error = {"message": "the server shut down", "type": "server_error", "param": None,
             "code": "server_shutting_down"}  # fmt: skip
    frames.append(writer.failure({"error": error}))
    events = events_of(b"".join(frames).decode())
    (_, said), (_, failed) = events[-2:]
    assert said["type"] == "error" and said["code"] == "server_shutting_down"
    assert said["message"] == "the server shut down"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == "server_error"
    assert message_text(failed["response"]) == "Hel"
    assert len(writer.store) == 0  # a failed response is not kept

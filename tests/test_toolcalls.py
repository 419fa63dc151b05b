"""Tool calls: each family's format parsed into OpenAI tool_calls, calls forced with a grammar so
the tiny model writes them with real sampling (tool_choice required or named), then the server:
the openai client's parsed tool_calls, SSE deltas, tool results rendered back, reasoning_content,
bad input."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx  # the openai client is built on httpx2
import openai
import pytest

from cli.api.replies import ChatReply
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.toolcalls import call_format, forcing_grammar, parse_tool_calls

from conftest import start_server
from tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"
CITIES = ["Paris", "Rome", "Lima"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(
    ("text", "fmt", "content", "calls"),
    [
        (
            'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
            "</tool_call>",
            "hermes",
            "Let me look.",
            [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "UTC"})],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Lima"}}',
            "llama3",
            "",
            [("get_weather", {"city": "Lima"})],
        ),
        (
            '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]',
            "mistral",
            "",
            [("get_time", {"zone": "CET"})],
        ),
        (
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
            "mistral",
            "",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            '[{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            "json",
            "",
            [("get_time", {"zone": "UTC"})],
        ),
        ("The weather is fine.", "hermes", "The weather is fine.", []),
        ('<tool_call>{"name": "get_weather", "argu', "hermes", None, []),  # unfinished
        ('{"name": "get_weather"', "llama3", None, []),
    ],
)
def test_formats_parse_into_tool_calls(text: str, fmt: str, content, calls) -> None:
    got_content, got = parse_tool_calls(text, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (text if content is None else content)  # same path: no model here
    assert len({c.id for c in got}) == len(got)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("tools")
    made = {}
    for name in (
        "Qwen-Qwen2.5-7B-Instruct",
        "meta-llama-Llama-3.1-8B-Instruct",
        "mistralai-Mistral-Nemo-Instruct-2407",
        "google-gemma-2-2b-it",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    ):
        source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        made[name] = write_tiny_llama(folder / f"{name}.gguf", n_layer=1, chat_template=source)
    return made


@pytest.mark.parametrize(
    ("name", "fmt", "required"),
    [
        ("Qwen-Qwen2.5-7B-Instruct", "hermes", "*"),
        ("meta-llama-Llama-3.1-8B-Instruct", "llama3", "get_weather"),
        ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", "get_time"),
        ("google-gemma-2-2b-it", "json", "*"),
    ],
)
def test_forced_calls_are_written_and_parsed_in_each_format(
    name: str, fmt: str, required: str, family_models: dict
) -> None:
    """The grammar makes the tiny model write a call in its family's format; the reply parser
    the server uses reads it back: a name that was allowed, arguments that follow the schema."""
    messages = ASK if fmt != "json" else [{"role": "user", "content": "Weather?"}]
    with Engine(family_models[name], LoadOptions(n_ctx=1024, threads=1)) as engine:
        assert call_format(engine.chat_template.family) == fmt
        tools = TOOLS if fmt != "json" else None  # gemma's template takes no tools
        prompt = engine.chat_prompt(messages, tools=tools)
        grammar = forcing_grammar(TOOLS, required, fmt)
        for seed in (1, 2, 3):
            sampling = SamplingParams(temperature=1.0, seed=seed, grammar=grammar)
            reply = ChatReply(prompt, TOOLS, fmt)
            raw = ""
            for event in engine.stream_text(prompt, 200, sampling):
                raw += event.text
                reply.feed(event.text, event.finish_reason is not None)
            assert event.finish_reason == "stop", raw
            assert reply.finish_reason("stop") == "tool_calls", raw
            (call,) = reply.calls
            assert required in ("*", call.name)
            arguments = json.loads(call.arguments)
            assert arguments in ({"city": c} for c in CITIES) or arguments in (
                {"zone": "UTC"},
                {"zone": "CET"},
            )
            message = reply.message()
            assert message["tool_calls"][0]["function"]["name"] == call.name


@pytest.fixture(scope="module")
def hermes_server(family_models: dict, quill_home, tmp_path_factory) -> Iterator[str]:
    process, url = start_server(
        quill_home,
        tmp_path_factory.mktemp("serve-tools"),
        str(family_models["Qwen-Qwen2.5-7B-Instruct"]),
        "--parallel", "2", "--ctx", "1024",
    )  # fmt: skip
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_openai_client_gets_tool_calls_whole_and_streamed(
    hermes_server: str, family_models: dict
) -> None:
    client = openai.OpenAI(base_url=f"{hermes_server}/v1", api_key="none", max_retries=0)
    ask = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120}
    whole = client.chat.completions.create(model="quill", seed=5, temperature=1.0, **ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)

    stream = client.chat.completions.create(
        model="quill", seed=5, temperature=1.0, stream=True, **ask
    )
    names, arguments, finish, contents = [], "", None, []
    for chunk in stream:
        delta = chunk.choices[0].delta
        for streamed in delta.tool_calls or []:
            assert streamed.index == 0
            if streamed.function.name:
                names.append(streamed.function.name)
            arguments += streamed.function.arguments or ""
        if delta.content:
            contents.append(delta.content)
        finish = chunk.choices[0].finish_reason or finish
    # the same seed: the same call, streamed
    assert names == [call.function.name] and arguments == call.function.arguments
    assert finish == "tool_calls" and not contents

    # A named function is the one called.
    named = client.chat.completions.create(
        model="quill",
        seed=6,
        temperature=1.0,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=120,
    )
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"

    # The result goes back as a tool message: the template renders it into the prompt.
    back = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model="quill", seed=1, messages=back, tools=TOOLS, max_tokens=4
    )
    with Engine(family_models["Qwen-Qwen2.5-7B-Instruct"], LoadOptions(n_ctx=1024)) as engine:
        dicts = [*ASK, back[1] | {"tool_calls": [_as_template_call(call)]}, back[2]]
        prompt = engine.chat_prompt(dicts, tools=TOOLS)
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
        assert answer.usage.prompt_tokens == len(engine.tokenize(prompt))


def _as_template_call(call) -> dict:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_every_tool_choice_mode_is_honoured(hermes_server: str, stream: bool) -> None:
    """auto and none, required and a named function, whole and streamed: none takes the tools
    out of the prompt (fewer prompt tokens, never a call), auto puts them in and lets the model
    choose, required makes some call, and a named function is the one called."""
    client = openai.OpenAI(base_url=f"{hermes_server}/v1", api_key="none", max_retries=0)

    def ask(choice) -> tuple[list[str], str | None, int]:
        """The names called, the finish reason, the prompt's tokens."""
        asked = dict(model="quill", seed=3, temperature=1.0, messages=ASK, max_tokens=120)
        if choice is not None:
            asked |= {"tools": TOOLS, "tool_choice": choice}
        if not stream:
            reply = client.chat.completions.create(**asked)
            calls = reply.choices[0].message.tool_calls or []
            names = [call.function.name for call in calls]
            return names, reply.choices[0].finish_reason, reply.usage.prompt_tokens
        names, finish, usage = [], None, None
        chunks = client.chat.completions.create(
            **asked, stream=True, stream_options={"include_usage": True}
        )
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage.prompt_tokens
            for choice_chunk in chunk.choices:
                names += [
                    c.function.name for c in choice_chunk.delta.tool_calls or [] if c.function.name
                ]
                finish = choice_chunk.finish_reason or finish
        return names, finish, usage

    bare = ask(None)
    none = ask("none")
    assert none[0] == [] and none[1] != "tool_calls" and none[2] == bare[2]
    auto = ask("auto")
    assert auto[2] > bare[2]  # the tools are in the prompt
    assert auto[1] == ("tool_calls" if auto[0] else auto[1])
    required = ask("required")
    assert required[1] == "tool_calls" and required[0] in (["get_weather"], ["get_time"])
    named = ask({"type": "function", "function": {"name": "get_time"}})
    assert named[1] == "tool_calls" and named[0] == ["get_time"]
    assert required[2] == named[2] == auto[2]


def test_bad_tool_requests_get_one_clear_400(hermes_server: str) -> None:
    def post(**body) -> httpx.Response:
        return httpx.post(
            f"{hermes_server}/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 4, **body},
            timeout=60,
        )

    for body, words in (
        ({"tools": {"name": "get_weather"}}, "'tools' must be an array"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be an object"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "nope"}}}, "names 'nope'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
    ):
        response = post(**body)
        assert response.status_code == 400, body
        assert words in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("choice", "constraint"),
    [
        ("required", {"response_format": {"type": "json_object"}}),
        ("required", {"grammar": 'root ::= "yes"'}),
        (
            {"type": "function", "function": {"name": "get_time"}},
            {"json_schema": {"type": "object"}},
        ),
    ],
    ids=["required and response_format", "required and grammar", "named and json_schema"],
)
def test_a_forced_call_with_an_output_constraint_is_a_400(
    hermes_server: str, choice, constraint: dict
) -> None:
    """The constraint's grammar took the forced call's place: a 200 with no tool call. As
    llama-server refuses a grammar with tools, both are refused, saying why."""
    body = {"messages": ASK, "max_tokens": 40, "tools": TOOLS, "tool_choice": choice}
    response = httpx.post(
        f"{hermes_server}/v1/chat/completions", json={**body, **constraint}, timeout=60
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "not supported together" in error["message"]
    assert next(iter(constraint)) in error["message"]
    free = {**body, "tool_choice": "auto", **constraint}  # the model may answer in the format
    assert httpx.post(f"{hermes_server}/v1/chat/completions", json=free, timeout=60).is_success


def test_a_call_cut_by_max_tokens_stays_content_with_finish_length(hermes_server: str) -> None:
    client = openai.OpenAI(base_url=f"{hermes_server}/v1", api_key="none", max_retries=0)
    cut = client.chat.completions.create(
        model="quill", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=12, seed=1
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")


def test_serve_sends_reasoning_content_apart(
    family_models: dict, quill_home, tmp_path_factory
) -> None:
    """DeepSeek-R1's template opens <think> in the prompt: what the model writes is reasoning,
    in message.reasoning_content and delta.reasoning_content, never in content; and it is the
    raw text the completions endpoint gives for the same prompt and seed."""
    path = family_models["deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"]
    process, url = start_server(
        quill_home, tmp_path_factory.mktemp("serve-r1"), str(path), "--parallel", "1", "--think"
    )
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        # No prefix cache: each request prefills in full, one batch, so the three requests take
        # one compute path and give one text.
        ask = {"model": "quill", "messages": ASK, "max_tokens": 8, "seed": 3,
               "extra_body": {"cache_prompt": False}}  # fmt: skip
        whole = client.chat.completions.create(**ask).model_dump()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] and not message["content"]
        streamed, content = "", ""
        for chunk in client.chat.completions.create(stream=True, **ask):
            delta = chunk.choices[0].delta.model_dump()
            streamed += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
        assert streamed == message["reasoning_content"]  # same path: no prefix cache
        assert content == ""
        with Engine(path, LoadOptions(n_ctx=512)) as engine:
            prompt = engine.chat_prompt(ASK, enable_thinking=True)
        raw = client.completions.create(
            model="quill", prompt=prompt, max_tokens=8, seed=3, extra_body={"cache_prompt": False}
        )
        assert raw.choices[0].text == streamed  # same path: no prefix cache
        # chat_template_kwargs turns the switch per request: the block is closed in the prompt
        switch = {"chat_template_kwargs": {"enable_thinking": False}, "cache_prompt": False}
        off = client.chat.completions.create(**{**ask, "extra_body": switch})
        off = off.model_dump()["choices"][0]["message"]
        assert off["content"] and not off.get("reasoning_content")
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_a_lone_surrogate_in_tools_is_a_400(hermes_server: str) -> None:
    bad = json.loads(json.dumps(TOOLS))
    bad[0]["function"]["description"] = "x\ud800"
    response = httpx.post(
        f"{hermes_server}/v1/chat/completions",
        content=json.dumps({"messages": ASK, "tools": bad, "max_tokens": 2}),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400 and "lone surrogate" in response.json()["error"]["message"]


def test_hermes_calls_stream_as_each_block_closes() -> None:
    """A <tool_call> block goes out as its own tool_calls delta as soon as it closes, before the
    reply ends; content before it goes first; an unfinished block at the end is not a call."""
    text = (
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
        '<tool_call>{"name": "get_'
    )
    first_close = text.index("</tool_call>") + len("</tool_call>")
    reply = ChatReply("prompt", TOOLS, "hermes")
    before = reply.feed(text[:first_close], finished=False)
    assert before[0] == {"content": "Let me look."}
    assert before[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    after = reply.feed(text[first_close:], finished=True)
    assert [d["tool_calls"][0]["index"] for d in after] == [1]
    assert reply.finish_reason("length") == "tool_calls"
    message = reply.message()
    assert message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]

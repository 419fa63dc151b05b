"""A chat template or tools quill cannot use: run and chat say so in one line, not a traceback (a
template that overflows, divides by zero, asks for more memory than there is, renders nothing or
is empty), and serve answers 400 for it, and for bad tools, schemas and seeds, and keeps serving."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from cli.app import app

from conftest import start_server
from refusals import home as home
from refusals import one_short_error_line as one_error_line

RANGE_TEMPLATE = "{% for i in range(1000000000) %}x{% endfor %}{{ messages[0].content }}"


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        (RANGE_TEMPLATE, "the chat template failed: OverflowError"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ('{{ "{:>99999999999}".format("x") }}', "larger than memory"),
        ("{% if false %}x{% endif %}", "rendered nothing"),
        ("", "is empty"),
        ("  \n", "is empty"),
    ],
)
def test_a_bad_chat_template_is_one_line_not_a_traceback(
    runner, home, tiny_path, tmp_path, template, needle
):
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for command in (["run", "-n", "2", "hi"], ["chat", "-n", "2"]):
        result = runner.invoke(
            app, [command[0], "-m", str(tiny_path), "--chat-template", str(path), *command[1:]],
            input="hi\n",
        )  # fmt: skip
        assert result.exception is None or isinstance(result.exception, SystemExit)
        if command[0] == "run" or "is empty" in needle:
            assert result.exit_code == 2, (result.stderr, result.exception)
        one_error_line(result.stderr, needle)
        assert result.stdout == ""


def _tool(name: str = "f", parameters: object = None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


BAD_REQUESTS = {
    "$ref #": {"tools": [_tool(parameters={"$ref": "#"})], "tool_choice": "required"},
    "a $ref to nothing": {
        "tools": [_tool(parameters={"type": "object", "properties": {"a": {"$ref": "#/x"}}})],
        "tool_choice": "required",
    },
    "a $ref that is a number": {
        "tools": [_tool(parameters={"type": "object", "properties": {"a": {"$ref": 5}}})]
    },
    "properties a list": {"tools": [_tool(parameters={"type": "object", "properties": [1]})]},
    "a bound of 1e400": {
        "tools": [
            _tool(
                parameters={
                    "type": "object",
                    "properties": {"a": {"type": "integer", "maximum": 1e400}},
                }
            )
        ],
        "tool_choice": "required",
    },
    "a name with a quote": {"tools": [_tool(name='say"hi')], "tool_choice": "required"},
    "a name with a backslash": {"tools": [_tool(name="a\\b")], "tool_choice": "required"},
    "an empty name": {"tools": [_tool(name="")]},
    "tool_choice's function a string": {
        "tools": [_tool()],
        "tool_choice": {"type": "function", "function": "f"},
    },
    "a seed past 32 bits": {"seed": 2**32},
    "response_format bound 1e400": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "integer", "minimum": 1e400}},
        }
    },
}


def test_serve_answers_400_for_bad_templates_and_tools_and_keeps_serving(home, tiny_path, tmp_path):
    template = tmp_path / "range.jinja"
    template.write_text(RANGE_TEMPLATE)
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    process, url = start_server(
        home, tmp_path, "-m", str(tiny_path), "--ctx", "512", "--chat-template", str(template)
    )
    try:
        response = httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "chat_template_error" and "OverflowError" in error["message"]
    finally:
        process.terminate()
        process.wait(timeout=30)
    process, url = start_server(home, tmp_path, "-m", str(tiny_path), "--ctx", "512")
    try:
        for name, extra in BAD_REQUESTS.items():
            # json.dumps writes 1e400 as Infinity, which is not JSON: send the number itself.
            body = json.dumps({**hello, **extra}).replace("Infinity", "1e400")
            response = httpx.post(
                f"{url}/v1/chat/completions", content=body, timeout=60,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["type"] == "invalid_request_error", name
        response = httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60)
        assert response.status_code == 200 and process.poll() is None
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert "failed:" not in process.stderr.read()  # no request ended in the 500 handler

"""A server behind --api-key: a key no client could send is refused at start (exit 2), ps and stop
refused the key exit 6 saying to pass it, and a request that passes the key is still checked: a
field of the wrong JSON type, or a strict flag that is not a boolean, is a 400 naming it. One keyed
server serves the module."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from conftest import QUILL, quill_env, start_server
from refusals import home as home
from refusals import one_short_error_line as one_error_line

# A value of the wrong JSON type, and the field the 400 must name: each was once read as if
# meant (n: true == 1, 1.0 == 1, bool("false") is True, a truthy "false" streamed).
WRONG_TYPES = [
    ("n", True),
    ("n", 1.0),
    ("ignore_eos", "false"),
    ("stream", "false"),
    ("cache_prompt", "true"),
    ("max_tokens", 4.0),
    ("max_completion_tokens", True),
    ("top_k", 40.0),
    ("seed", 1.0),
    ("seed", False),
    ("temperature", "0"),
    ("top_logprobs", 2.0),
    ("n_probs", True),
]


SERVE_KEY = "untrusted-key"


@pytest.fixture(scope="module")
def keyed_tiny_server(tiny_path, tmp_path_factory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("keyed")
    process, url = start_server(
        folder / "home", folder, "-m", str(tiny_path), "--ctx", "256", "--api-key", SERVE_KEY
    )
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.mark.parametrize(("field", "value"), WRONG_TYPES)
def test_a_field_of_the_wrong_json_type_is_a_400_naming_it(keyed_tiny_server, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    response = httpx.post(
        f"{keyed_tiny_server}/v1/chat/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {SERVE_KEY}"},
    )  # fmt: skip
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"'{field}' must be" in error["message"], error


def test_a_strict_flag_that_is_not_a_boolean_is_a_400(keyed_tiny_server):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": "false"},
        },
    }
    response = httpx.post(
        f"{keyed_tiny_server}/v1/chat/completions", json=body, timeout=60,
        headers={"Authorization": f"Bearer {SERVE_KEY}"},
    )  # fmt: skip
    assert response.status_code == 400, response.text
    assert "'strict' must be true or false" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "args",
    [["ps"], ["stop", "tiny"]],
    ids=["ps", "stop"],
)
@pytest.mark.parametrize("given", [None, "wrong-key"], ids=["no key", "a wrong key"])
def test_ps_and_stop_refused_a_key_exit_6_saying_to_pass_it(keyed_tiny_server, args, given):
    key = ["--api-key", given] if given else []
    result = subprocess.run(
        [QUILL, *args, "--endpoint", keyed_tiny_server, *key], capture_output=True, text=True,
        env={k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}, timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 6, result.stderr
    one_error_line(result.stderr, "answered 401")
    assert "--api-key" in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("key", "needle"),
    [("", "--api-key is empty"), (" key", "spaces at its ends"), ("clé", "printable ASCII")],
    ids=["empty", "a leading space", "not ASCII"],
)
def test_an_api_key_no_client_could_send_is_exit_2_at_start(tiny_path, home, key, needle):
    result = subprocess.run(
        [QUILL, "serve", "-m", str(tiny_path), "--port", "0", "--api-key", key],
        capture_output=True, text=True, env=quill_env(home), timeout=60,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    one_error_line(result.stderr, needle)
    assert "quill serve:" not in result.stderr  # refused before it loaded or listened

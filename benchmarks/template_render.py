"""What rendering a chat template costs, and what quill's bounds (a trace-function deadline, an
output cap) add to it: per published template in tests/data/templates, the median time to render
a fixed conversation (system, user, assistant, user; with tools where the template takes them)
with quill's renderer and with a plain Jinja sandbox set up as transformers sets it up.

Usage: python -m benchmarks.template_render [--repeat 200]
The time is part of every request's TTFT (the prompt is rendered before prefill).
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import ROOT, median_ms
from cli.engine.templates import render_jinja

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And the weather in Paris?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def plain_environment():
    """Jinja's sandbox as transformers configures it, without quill's bounds."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda f: time.strftime(f)
    return env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    env = plain_environment()
    print(f"{'template':50} {'quill ms':>9} {'plain ms':>9} {'ratio':>6}")
    for path in sorted((ROOT / "tests" / "data" / "templates").glob("*.jinja")):
        source = path.read_text(encoding="utf-8")
        tools = TOOLS if "tools" in source else None
        messages = CONVERSATION if "gemma" not in path.name else CONVERSATION[1:]
        compiled = env.from_string(source)

        def quill(source=source, messages=messages, tools=tools):
            return render_jinja(source, messages, tools=tools)

        def plain(compiled=compiled, messages=messages, tools=tools):
            return compiled.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )

        quill()  # compile once, as a server does
        (ours, _), (theirs, _) = median_ms(quill, args.repeat), median_ms(plain, args.repeat)
        print(f"{path.stem[:50]:50} {ours:9.3f} {theirs:9.3f} {ours / theirs:6.2f}")


if __name__ == "__main__":
    main()

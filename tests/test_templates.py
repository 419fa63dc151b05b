"""Chat templates: quill renders the published templates of many families byte for byte as
transformers' apply_chat_template does (the independent renderer, a test-only dependency), each
template written into a tiny GGUF with gguf's writer and read back through llama.cpp; hostile
templates are stopped with one line; template-less files get a family, said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.templates import render_jinja
from cli.errors import ChatTemplateError

from tinymodel import write_tiny_llama

TEMPLATES = Path(__file__).parent / "data" / "templates"

# The template files as llama.cpp's sources keep them, named by model; the family quill names.
FAMILY_OF = {
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "Qwen-Qwen2.5-7B-Instruct": "chatml",
    "Qwen-Qwen3-0.6B": "chatml",
    "google-gemma-2-2b-it": "gemma",
    "microsoft-Phi-3.5-mini-instruct": "phi3",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-v7",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral-v3",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek3",
    "HuggingFaceTB-SmolLM3-3B": "chatml",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "chatml",
    "openai-gpt-oss-120b": "gpt-oss",
}

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATION = [
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
                "properties": {"city": {"type": "string", "description": "City name <ok> & é"}},
                "required": ["city"],
            },
        },
    }
]


def reference_render(source: str, messages: list, bos: str, eos: str, **kwargs) -> str:
    """transformers' own renderer: what the template's authors test against."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        [messages],
        chat_template=source,
        add_generation_prompt=True,
        bos_token=bos,
        eos_token=eos,
        **kwargs,
    )
    return rendered[0]


def special_tokens(path: Path) -> tuple[str, str]:
    reader = GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    return tokens[bos], tokens[eos]


@pytest.fixture(scope="module")
def template_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("templates")
    made = {}
    for name in FAMILY_OF:
        source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
        made[name] = write_tiny_llama(folder / f"{name}.gguf", n_layer=1, chat_template=source)
    return made


def _variants(source: str) -> list[tuple[str, list, dict]]:
    conversations = [("with system", [SYSTEM, *CONVERSATION]), ("no system", CONVERSATION)]
    variants = []
    for label, messages in conversations:
        variants.append((label, messages, {}))
        variants.append((f"{label}, tools", messages, {"tools": TOOLS}))
        if "enable_thinking" in source:
            for think in (True, False):
                switch = {"enable_thinking": think}
                variants.append((f"{label}, thinking {think}", messages, switch))
                variants.append(
                    (f"{label}, tools, thinking {think}", messages, {**switch, "tools": TOOLS})
                )
    return variants


@pytest.mark.parametrize("name", sorted(FAMILY_OF))
def test_published_templates_render_as_transformers_does(name: str, template_models: dict) -> None:
    path = template_models[name]
    source = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    bos, eos = special_tokens(path)
    compared = 0
    with Engine(path, LoadOptions(n_ctx=512, threads=1)) as engine:
        template = engine.chat_template
        assert template is not None and template.source == source  # read back through llama.cpp
        assert template.family == FAMILY_OF[name]
        for label, messages, kwargs in _variants(source):
            try:
                expected = reference_render(source, messages, bos, eos, **kwargs)
            except Exception as error:  # the template refuses this conversation (e.g. a system
                # role): quill must refuse it too, with the template's own reason
                with pytest.raises(ChatTemplateError) as refused:
                    render_jinja(source, messages, bos_token=bos, eos_token=eos, **_split(kwargs))
                assert str(error).split("\n")[0][:40] in str(refused.value), label
                continue
            got = engine.chat_prompt(
                messages, tools=kwargs.get("tools"), enable_thinking=kwargs.get("enable_thinking")
            )
            assert got == expected, f"{name}, {label}"
            compared += 1
        # No fallback was taken (gpt-oss's line says a fact of its format, not a fallback).
        assert all("channel format" in note for note in engine.notes)
    assert compared >= 2


def _split(kwargs: dict) -> dict:
    extra = {k: v for k, v in kwargs.items() if k != "tools"}
    return {"tools": kwargs.get("tools"), "extra": extra}


def test_thinking_switch_changes_the_prompt(template_models: dict) -> None:
    with Engine(template_models["Qwen-Qwen3-0.6B"], LoadOptions(n_ctx=512, threads=1)) as engine:
        on = engine.chat_prompt(CONVERSATION, enable_thinking=True)
        off = engine.chat_prompt(CONVERSATION, enable_thinking=False)
        engine.enable_thinking = False  # what --no-think sets
        assert engine.conversation_text(CONVERSATION)[0] == off
    assert off.endswith("<think>\n\n</think>\n\n") and not on.endswith("</think>\n\n")


def test_hostile_templates_are_stopped_with_one_line() -> None:
    looping = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"more than 0\.5 s"):
        render_jinja(looping, CONVERSATION, seconds=0.5)
    with pytest.raises(ChatTemplateError, match="size limit"):
        render_jinja("{{ 'x' * 10000000000 }}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="recursed"):
        render_jinja("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="raised: roles must alternate"):
        render_jinja("{{ raise_exception('roles must alternate') }}", CONVERSATION)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_jinja("{% for %}", CONVERSATION)
    # The sandbox: no way out to Python internals.
    with pytest.raises(ChatTemplateError):
        render_jinja("{{ messages.__class__.__mro__[1].__subclasses__() }}", CONVERSATION)


def test_tojson_keeps_html_and_unicode_as_transformers_does() -> None:
    source = "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}"
    got = render_jinja(source, [], tools=TOOLS)
    assert got == reference_render(source, [], "", "", tools=TOOLS)
    assert "<ok> & é" in got


def test_run_with_a_raising_template_falls_back_with_one_warning(runner, tmp_path: Path) -> None:
    """A template that raises, but that llama.cpp recognises (ChatML markers): one warning line
    naming why, and the reply still comes."""
    from cli.app import app

    source = (
        "{% if messages | length > 0 %}{{ raise_exception('no conversations today') }}{% endif %}"
        "<|im_start|>"
    )
    path = write_tiny_llama(tmp_path / "raises.gguf", n_layer=1, chat_template=source)
    result = runner.invoke(app, ["run", "-m", str(path), "hi", "-n", "3", "--json", "--seed", "1"])
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "no conversations today" in warnings[0], result.stderr
    assert "llama.cpp's built-in template" in warnings[0]
    assert json.loads(result.stdout)["generation_tokens"] == 3


def test_run_with_a_looping_template_it_cannot_fall_back_from(runner, tmp_path: Path) -> None:
    from cli.app import app

    template = tmp_path / "loop.jinja"
    template.write_text("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}"
                        "{% endfor %}", encoding="utf-8")  # fmt: skip
    path = write_tiny_llama(tmp_path / "t.gguf", n_layer=1)
    result = runner.invoke(app, ["run", "-m", str(path), "hi", "--chat-template", str(template)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "stopped" in lines[0] and "loop" in lines[0], result.stderr
    assert result.stdout == ""


def test_chat_template_file_overrides_the_models_own(
    runner, tmp_path: Path, tiny_path: Path
) -> None:
    """--chat-template FILE renders instead of the file's template: the prompt token count
    follows the chosen template (quill against quill, no pasted text)."""
    from cli.app import app

    short = tmp_path / "short.jinja"
    short.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    args = ["run", "-m", str(tiny_path), "hello there", "-n", "1", "--json", "--seed", "3"]
    own = runner.invoke(app, args)
    mine = runner.invoke(app, [*args, "--chat-template", str(short)])
    assert own.exit_code == 0 and mine.exit_code == 0, mine.stderr
    ours = json.loads(mine.stdout)["prompt_tokens"]
    theirs = json.loads(own.stdout)["prompt_tokens"]
    from cli.engine.engine import Engine

    with Engine(tiny_path, LoadOptions(n_ctx=256, threads=1)) as engine:
        assert ours == len(engine.tokenize("hello there"))
        assert theirs == len(engine.tokenize(engine.chat_prompt([("user", "hello there")])))
    assert ours < theirs
    missing = runner.invoke(app, [*args, "--chat-template", str(tmp_path / "nope.jinja")])
    assert missing.exit_code == 2 and "cannot read the chat template" in missing.stderr


def test_a_file_without_template_gets_its_family_said_in_one_line(runner, tmp_path: Path) -> None:
    from cli.app import app
    from cli.commands.templating import registry_family

    path = write_tiny_llama(tmp_path / "bare.gguf", n_layer=1, chat_template="")
    result = runner.invoke(app, ["run", "-m", str(path), "hi", "-n", "2", "--seed", "1"])
    assert result.exit_code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if "no chat template" in line]
    assert len(said) == 1 and "chatml" in said[0] and "tokens point to" in said[0]
    # A registry entry names its family, and that wins over the inference.
    assert registry_family("gemma3-270m") == "gemma"
    assert registry_family("qwen3-0.6b:q8_0") == "chatml"
    lines: list[str] = []
    family = registry_family("gemma3-270m")
    with Engine(
        path, LoadOptions(n_ctx=256, threads=1), family=family, on_note=lines.append
    ) as engine:
        assert engine.chat_template.family == "gemma" and "models.yaml" in lines[0]
        prompt = engine.conversation_text([("user", "hi")])[0]
    assert prompt == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_inspect_names_the_family_and_what_it_supports(runner, template_models: dict) -> None:
    from cli.app import app

    result = runner.invoke(app, ["inspect", str(template_models["Qwen-Qwen3-0.6B"]), "--json"])
    assert result.exit_code == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["template_family"] == "chatml"
    assert info["template_supports"] == {"tools": True, "thinking": True, "thinking_switch": True}
    shown = runner.invoke(app, ["inspect", str(template_models["google-gemma-2-2b-it"])])
    assert "family gemma, no tools, no thinking" in shown.stdout


def test_the_tool_use_template_renders_when_tools_are_given(tmp_path: Path) -> None:
    """A file with named templates (as NousResearch's Hermes ships): tokenizer.chat_template for
    plain chats, tokenizer.chat_template.tool_use when the request has tools."""
    hermes = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text("utf-8")
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    path = write_tiny_llama(
        tmp_path / "named.gguf",
        n_layer=1,
        chat_template=[
            {"name": "default", "template": plain},
            {"name": "tool_use", "template": hermes},
        ],
    )
    bos, eos = special_tokens(path)
    with Engine(path, LoadOptions(n_ctx=256, threads=1)) as engine:
        assert engine.chat_template.supports_tools
        assert engine.chat_prompt(CONVERSATION) == reference_render(plain, CONVERSATION, bos, eos)
        with_tools = engine.chat_prompt(CONVERSATION, tools=TOOLS)
    assert with_tools == reference_render(hermes, CONVERSATION, bos, eos, tools=TOOLS)
    assert "get_weather" in with_tools


def test_gpt_oss_channels_are_said_not_split(runner, template_models: dict) -> None:
    from cli.app import app

    path = template_models["openai-gpt-oss-120b"]
    result = runner.invoke(app, ["run", "-m", str(path), "hi", "-n", "2", "--seed", "1"])
    assert result.exit_code == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("quill: warning")]
    assert len(said) == 1 and "not split" in said[0]


def test_chat_takes_the_chat_template_too(runner, tmp_path: Path, tiny_path: Path) -> None:
    """chat renders through the same path as run: the same --chat-template gives the same
    prompt token count."""
    import re

    from cli.app import app

    short = tmp_path / "short.jinja"
    short.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}", "utf-8")
    common = ["-m", str(tiny_path), "-n", "1", "--seed", "3", "--chat-template", str(short)]
    chat = runner.invoke(app, ["chat", *common], input="hello there\n")
    assert chat.exit_code == 0, chat.stderr
    prefilled = int(re.search(r"prefill (\d+) new tokens", chat.stderr).group(1))
    run = runner.invoke(app, ["run", *common, "--json", "hello there"])
    assert json.loads(run.stdout)["prompt_tokens"] == prefilled

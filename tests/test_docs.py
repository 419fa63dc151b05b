"""The docs cannot drift from the program: the reference is regenerated and compared, every
`$ quill ...` line in docs/ and the README must parse with today's flags, links must resolve,
and the greedy or seeded `quill run` examples are run again and must print what the docs show."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.app import app
from cli.docgen import reference_markdown

ROOT = Path(__file__).resolve().parent.parent
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "&", "(", ")"}


REDIRECTION = re.compile(r"\s\d*>>?&?\s*\S+")


def quill_commands(paths: list[Path] = DOCS) -> list[tuple[str, int, list[str], str, bool]]:
    """(file, line number, argv after `quill`, the text shown after it, whether the line is a
    plain command: `quill ...` with no pipe or redirection, at most a `$(...)` argument) for
    each example."""
    found = []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            if not line.startswith("$ ") or "quill " not in line:
                continue
            command = REDIRECTION.sub(" ", line[2:])
            lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
            if "quill" not in tokens:
                continue
            start = tokens.index("quill") + 1
            argv = []
            for token in tokens[start:]:
                if token in OPERATORS:
                    break
                argv.append(token)
            plain = (start == 1 and len(argv) == len(tokens) - 1 and command == line[2:]) or (
                line.startswith("$ quill ") and "$(" in line and "|" not in line
            )
            shown = []
            for following in lines[number:]:
                if following.startswith(("$ ", "```")):
                    break
                shown.append(following)
            found.append((path.name, number, argv, "\n".join(shown), plain))
    return found


COMMANDS = quill_commands()


def test_the_reference_is_up_to_date():
    on_disk = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert on_disk == reference_markdown(), (
        "docs/reference.md is out of date: python -m cli.docgen > docs/reference.md"
    )


def test_the_docs_show_many_commands():
    assert len(COMMANDS) >= 40
    shown = {argv[0] for _, _, argv, _, _ in COMMANDS if argv}
    group = typer.main.get_command(app)
    assert shown >= {"run", "chat", "quantize", "perplexity", "serve", "tokenize", "bench"}
    assert set(group.list_commands(None)) - shown <= {"rm", "pull", "list", "inspect"} - shown


@pytest.mark.parametrize(("doc", "line", "argv", "shown", "_plain"), COMMANDS,
                         ids=[f"{d}:{n}" for d, n, *_ in COMMANDS])  # fmt: skip
def test_every_documented_command_parses(doc, line, argv, shown, _plain):
    """Unknown flags, wrong types, missing arguments fail the parse as they would for a user;
    only an example that shows that very error may fail."""
    from typer._click.exceptions import ClickException

    group = typer.main.get_command(app)
    if argv in (["--help"], ["--version"]):
        return
    name, rest = argv[0], argv[1:]
    command = group.get_command(None, name)
    assert command is not None, f"{doc}:{line}: no command {name!r}"
    if "--help" in rest or "-h" in rest:
        return
    try:
        command.make_context(name, list(rest))
    except ClickException as error:
        assert "quill: error:" in shown, f"{doc}:{line}: {error.format_message()}"


def test_links_between_docs_resolve():
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


GREEDY_RUNS = [
    (doc, line, argv, shown)
    for doc, line, argv, shown, plain in COMMANDS
    if plain and argv[:1] == ["run"] and "quill: error:" not in shown
    and "--temperature" in argv and "--endpoint" not in argv
    and (argv[argv.index("--temperature") + 1] == "0" or "--seed" in argv)
    and not any(a.startswith("smollm2-135m:") or a.startswith("gemma") for a in argv)
]  # fmt: skip


def shown_reply(shown: str) -> str:
    """The reply an example shows: its lines up to the stats line or the end of the block."""
    lines = []
    for text in shown.splitlines():
        if text.startswith("load ") and " TTFT " in text:
            break
        if not text.startswith("quill: warning:"):  # stderr, before the reply in one pipe
            lines.append(text)
    # A reply may start with a newline (the model's first token): only the end is trimmed.
    return "\n".join(lines).rstrip("\n")


@pytest.fixture(scope="module")
def decoders(smollm2_path):
    """quill's engine (to build the prompt exactly as `quill run` does) and the independent
    reference decoders, one per KV cache type an example asks for (to feed the documented reply
    back, token by token)."""
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions

    from reference import Reference

    engine = Engine(smollm2_path, LoadOptions(threads=2))
    references: dict[str, Reference] = {}

    def reference(kv_type: str) -> Reference:
        if kv_type not in references:
            references[kv_type] = Reference(smollm2_path, threads=2, kv_type=kv_type)
        return references[kv_type]

    yield engine, reference
    for decoder in references.values():
        decoder.close()
    engine.close()


def example_prompt(engine, options: dict) -> list[int]:
    """The prompt tokens `quill run` builds for an example's options (system prompt, chat
    template file), with quill's own templating."""
    from cli.engine.engine import Engine
    from cli.engine.options import LoadOptions
    from cli.engine.settings import ModelSettings
    from cli.engine.templates import template_from_file

    messages = [("system", options["system"])] if options.get("system") else []
    messages.append(("user", options["prompt"]))
    if not options.get("chat_template"):
        return engine.tokenize(engine.chat_prompt(messages))
    settings = ModelSettings(chat_template=template_from_file(options["chat_template"]))
    with Engine(engine.path, LoadOptions(n_ctx=512, threads=1), settings=settings) as templated:
        return templated.tokenize(templated.chat_prompt(messages))


def documented_example_problem(decoders, argv: list[str], reply: str) -> str | None:
    """None when quill, on this machine, prints the documented reply or a near-tie of it
    (tests/neartie.py states the rule); else what is wrong. quill's own output on this machine
    is checked the same way: it may differ from the docs only where the docs' text is a near-tie."""
    from cli.commands.options import model_and_prompt
    from cli.engine.sampling import SamplingParams

    from neartie import text_mismatch

    engine, references = decoders
    result = CliRunner().invoke(app, [*argv, "--no-stats"])
    if result.exit_code != 0:
        return f"exited {result.exit_code}: {result.stderr}"
    printed = result.stdout.rstrip("\n")
    if "--json" in argv:  # the reply is the text field of the document shown
        printed, reply = json.loads(printed)["text"], json.loads(reply)["text"]
    run_command = typer.main.get_command(app).get_command(None, "run")
    options = run_command.make_context("run", list(argv[1:])).params
    words = list(options["words"] or ())  # run's positionals: [MODEL] PROMPT
    options["model"], options["prompt"] = model_and_prompt(words, options["model"])
    prompt = example_prompt(engine, options)
    reference = references(options["kv_type"] or "f16")
    sampling = SamplingParams(temperature=options["temperature"], seed=options["seed"])
    shown = len(reference.tokenize(reply, add_special=False))
    if shown > options["max_tokens"]:
        return f"shows {shown} tokens, but -n allows {options['max_tokens']}"
    for text in dict.fromkeys([reply, printed]):
        problem = text_mismatch(reference, prompt, text, sampling)
        if problem is not None:
            # same path: which of the two texts failed, for the message
            return problem if text == reply else f"quill printed {printed!r}: {problem}"
    return None


@pytest.mark.parametrize(("doc", "line", "argv", "shown"), GREEDY_RUNS,
                         ids=[f"{d}:{n}" for d, n, _, _ in GREEDY_RUNS])  # fmt: skip
def test_greedy_run_examples_print_what_the_docs_show(decoders, doc, line, argv, shown):
    problem = documented_example_problem(decoders, argv, shown_reply(shown))
    assert problem is None, f"{doc}:{line}: {problem}"


def test_an_edited_example_fails(decoders):
    """The near-tie tolerance must not excuse text quill does not print."""
    doc, line, argv, shown = next(r for r in GREEDY_RUNS if "KV cache" in r[2][-1])
    reply = shown_reply(shown)
    assert documented_example_problem(decoders, argv, reply) is None, f"{doc}:{line}"
    for word, other in (("cache", "potato"), ("data", "music")):
        edited = reply.replace(word, other, 1)
        assert edited != reply
        problem = documented_example_problem(decoders, argv, edited)
        assert problem is not None and "this machine picks" in problem, (word, problem)
    seeded = next(r for r in GREEDY_RUNS if "--seed" in r[2])
    reply = shown_reply(seeded[3])
    assert documented_example_problem(decoders, seeded[2], reply) is None
    word = re.findall(r"[a-z]{4,}", reply)[0]  # any word of the documented reply
    edited = reply.replace(word, "tax", 1)
    assert edited != reply
    assert documented_example_problem(decoders, seeded[2], edited) is not None


def test_pasted_help_is_current():
    from scripts.refresh_docs import current_help, help_blocks

    stale = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").split("\n")
        for start, end, args in help_blocks(lines):
            if [line.rstrip() for line in lines[start:end]] != current_help(args):
                stale.append(f"{path.name}:{start} quill {' '.join(args)} --help")
    assert not stale, (
        f"stale --help in the docs (python scripts/refresh_docs.py --help-blocks): {stale}"
    )


def test_troubleshooting_lists_every_exit_code_in_helps_words():
    from cli.errors import EXIT_CODES

    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    listed = dict(re.findall(r"^\| (\d+) \| (.+) \|$", text, re.M))
    assert {int(code): meaning for code, meaning in listed.items()} == EXIT_CODES


def test_the_readme_command_table_lists_every_command():
    from cli.app import COMMANDS

    table = (ROOT / "README.md").read_text().split("## Commands", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"^\| `quill ([\w-]+)", table, re.M))
    assert named == {name for name, *_ in COMMANDS}


def test_the_registry_list_in_models_md_is_models_yaml():
    from cli.docgen import registry_markdown

    assert registry_markdown() in (ROOT / "docs" / "models.md").read_text()

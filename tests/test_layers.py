"""The floor plan, kept by tests: which layer may import which, no import cycles, and a CLI that
starts without loading llama.cpp or numpy."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cli", "quant")
# What each layer must never import (anywhere in its modules, at the top or inside a function).
FORBIDDEN = {
    "cli.engine": ("typer", "rich", "click", "cli.ui", "cli.commands", "cli.store", "cli.api",
                   "cli.measure", "cli.app"),
    "cli.store": ("typer", "rich", "click", "cli.ui", "cli.commands", "cli.api", "cli.measure",
                  "cli.app"),
    "cli.measure": ("typer", "rich", "click", "cli.ui", "cli.commands", "cli.app"),
    "cli.api": ("typer", "rich", "click", "cli.ui", "cli.commands", "cli.measure", "cli.app"),
    "cli.ui": ("typer", "cli.commands", "cli.app"),
    "quant": ("cli", "typer", "rich", "click"),
}  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Every module a file imports, wherever the import statement is."""
    names = set()
    package = module_name(path)
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:  # relative: from the file's package
                base = ".".join([*package.split(".")[: -node.level], node.module])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(layer):
    breaches = []
    for name, path in modules().items():
        if not within(name, layer):
            continue
        for imported in imports_of(path):
            for forbidden in FORBIDDEN[layer]:
                if within(imported, forbidden):
                    breaches.append(f"{name} imports {imported}")
    assert not breaches, breaches


def test_nothing_imports_the_commands_but_the_app():
    breaches = [
        f"{name} imports {imported}"
        for name, path in modules().items()
        if not within(name, "cli.commands") and name != "cli.app"
        for imported in imports_of(path)
        if within(imported, "cli.commands")
    ]
    assert not breaches, breaches


def test_no_import_cycles():
    known = modules()
    graph = {
        name: {
            target
            for imported in imports_of(path)
            for target in (imported, imported.rpartition(".")[0])
            if target in known and target != name and known[target].name != "__init__.py"
        }
        for name, path in known.items()
    }
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("cli.app", ("llama_cpp", "numpy", "gguf", "huggingface_hub")),
        ("cli.engine.engine", ("typer", "rich", "click")),
        ("cli.engine.metrics", ("typer", "rich", "click", "llama_cpp")),
        ("cli.store.models", ("typer", "rich", "llama_cpp", "numpy")),
        ("quant", ("cli", "typer", "rich", "numpy", "gguf", "llama_cpp")),
    ],
)
def test_what_importing_a_module_loads(module, forbidden):
    # cli.app builds its full app (every command's module and signature) on first use of .app
    touch = "cli.app.app; " if module == "cli.app" else ""
    code = f"import sys, {module}; {touch}"
    code += f"print(sorted(m for m in {forbidden!r} if m in sys.modules))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]", f"{module} pulls in {result.stdout.strip()}"


def test_the_scheduler_leaves_the_llama_context_to_the_engine():
    """The engine owns the context and the one record of each sequence's cached tokens: the
    batch scheduler decodes and frees only through the engine's sequence operations."""
    scheduler = ROOT / "cli" / "engine" / "batching.py"
    assert not any(within(name, "llama_cpp") for name in imports_of(scheduler))
    source = scheduler.read_text(encoding="utf-8")
    assert "llama_memory" not in source and "_ctx" not in source


def test_the_token_step_is_written_once():
    """Only the SequenceStep assembles a StreamEvent from a sampled token; the client builds
    one from a server's chunks in one helper."""
    makers = {
        name: path.read_text(encoding="utf-8").count("StreamEvent(")
        for name, path in modules().items()
        if "StreamEvent(" in path.read_text(encoding="utf-8")
    }
    assert makers == {"cli.engine.tokenstep": 1, "cli.api.client": 1}, makers


def test_a_command_imports_only_what_it_runs(tmp_path):
    """`quill list` imports its own command module and the option kit, not the other commands,
    nor rich, PyYAML (the registry is kept as JSON after the first read) or llama.cpp: start-up
    time is what every command pays before it does anything."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(sorted(m for m in sys.modules if m.startswith("
        "('cli.commands.', 'rich', 'yaml', 'llama_cpp', 'numpy', 'pydantic'))), file=sys.stderr))\n"
        "sys.argv = ['quill', 'list', '--json']\n"
        "from cli.app import main\n"
        "main()\n"
    )
    env = {**os.environ, "QUILL_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    for _ in range(2):  # the first run reads models.yaml with PyYAML and keeps it
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
        )
        assert result.returncode == 0, result.stderr
    loaded = result.stderr.strip().splitlines()[-1]
    assert loaded == "['cli.commands.models', 'cli.commands.options']", loaded


def test_the_help_listing_says_what_each_docstring_says():
    """`quill --help` lists commands from a table (so it imports none of them); the table must
    hold each command's own first docstring sentence, and every command."""
    import re

    from cli.app import COMMANDS, SUMMARIES, _command_info

    assert list(SUMMARIES) == [name for name, *_ in COMMANDS]
    for name, *_ in COMMANDS:
        info = _command_info(name)
        assert info is not None and info.callback is not None
        doc = " ".join((info.callback.__doc__ or "").split())
        assert SUMMARIES[name] == re.split(r"(?<=[.?!])\s", doc, maxsplit=1)[0], name


def quill_flags() -> set[str]:
    """Every --long option a quill command takes, from the Typer app itself."""
    import typer

    from cli.app import app
    from cli.docgen import command_context

    group, root = command_context(app)
    flags: set[str] = set()
    for name in group.list_commands(root):
        command = group.get_command(root, name)
        assert command is not None
        for parameter in command.params:
            flags.update(o for o in (*parameter.opts, *parameter.secondary_opts) if o[:2] == "--")
    assert isinstance(group, typer.core.TyperGroup) and "--ctx" in flags
    return flags


def flags_written(path: Path, flags: set[str]) -> list[str]:
    """quill's flags in path's strings (docstrings and comments aside: they may say where a
    value comes from), and flags put together from pieces (f"--{name}")."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        pieces = node.values if isinstance(node, ast.JoinedStr) else [node]
        for index, piece in enumerate(pieces):
            if not isinstance(piece, ast.Constant) or not isinstance(piece.value, str):
                continue
            if id(piece) in docstrings:
                continue
            written = re.findall(r"--[a-z][a-z0-9-]*", piece.value)
            found += [f"{path.name}:{piece.lineno} {w}" for w in written if w in flags]
            built = re.search(r"(^|[\s(`'\"])--$", piece.value) and index + 1 < len(pieces)
            if built:
                found.append(f"{path.name}:{piece.lineno} --{{...}}")
    return found


def test_flag_names_are_written_only_by_the_commands():
    """Lower layers raise typed errors with facts and take advice as data: the options a user
    types are named in cli/commands/ and cli/app.py alone, so renaming one is one place."""
    flags = quill_flags()
    below = [
        path
        for name, path in modules().items()
        if not name.startswith("cli.commands") and name != "cli.app"
    ]
    written = [hit for path in below for hit in flags_written(path, flags)]
    assert not written, f"flag names below the commands: {written}"

"""The size of the house's rooms: a function a reader takes in at once (60 lines of body at most)
and a call a reader can follow (12 parameters at most). A Typer command's signature is its
options and may be long; its body may not."""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import modules

MAX_BODY_LINES = 60
MAX_PARAMETERS = 12


def typer_commands() -> set[tuple[str, str]]:
    """(module, function) of every command cli/app.py registers."""
    from cli.app import COMMANDS

    return {(f"cli.commands.{module}", function) for _, module, function, _ in COMMANDS}


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


def body_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = function.body
    first = body[0]
    if len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        first = body[1]
    assert function.end_lineno is not None
    return function.end_lineno - first.lineno + 1


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    names = [a.arg for a in named if a.arg not in ("self", "cls")]
    return len(names) + (arguments.vararg is not None) + (arguments.kwarg is not None)


def test_no_function_is_longer_than_a_screen():
    long = sorted(
        (body_lines(function), f"{name}.{function.name}")
        for name, path in modules().items()
        for function in functions(path)
        if body_lines(function) > MAX_BODY_LINES
    )
    assert not long, f"functions over {MAX_BODY_LINES} lines of body: {long}"


def test_only_typer_commands_take_more_than_twelve_parameters():
    commands = typer_commands()
    many = sorted(
        (parameters(function), f"{name}.{function.name}")
        for name, path in modules().items()
        for function in functions(path)
        if parameters(function) > MAX_PARAMETERS and (name, function.name) not in commands
    )
    assert not many, f"functions with over {MAX_PARAMETERS} parameters: {many}"


def test_the_measure_counts_what_it_says(tmp_path):
    """A docstring is not body; self is not a parameter; *args and **kwargs are."""
    source = tmp_path / "shape.py"
    body = "\n".join(f"    x{n} = {n}" for n in range(61))
    source.write_text(
        f'def long(a, b, *rest, c, **more):\n    """Doc."""\n{body}\n'
        "class Room:\n    def method(self, a):\n        return a\n"
    )
    long, method = functions(source)
    assert (body_lines(long), parameters(long)) == (61, 5)
    assert (body_lines(method), parameters(method)) == (1, 1)

"""No test compares texts that two compute paths produced with ==: greedy and seeded text is not
bit-identical across CPUs, nor across batch shapes, so such texts go through the near-tie
comparator (tests/neartie.py). An `==` (or `!=`) between two expressions that look like
generated text or tokens is allowed only with a `same path:` comment on its line or the line
above, saying why both sides come from one compute path (one command printed two ways, one
reply's own pieces, no model at all)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
# Names under which tests hold generated text or tokens.
GENERATED = re.compile(
    r"text|stdout|tokens?\b|\.token|content|reply|replies|printed|speculated|plain|greedy|"
    r"batched|single|streamed|pieces|outputs",
    re.IGNORECASE,
)
# Counts and rates with "tokens" in their names are numbers, not text.
COUNTS = re.compile(
    r"(prompt|generation|cached|cached_prompt|completion|thinking|answer|total|reused|max)_tokens"
    r"|tokens_scored|n_tokens|_tokens_per_s"
)
NOT_TEXT_CALLS = {"len", "set", "sorted", "int", "float", "bool", "type", "sum", "any", "all"}


def _looks_generated(node: ast.expr, source: str) -> bool:
    if isinstance(node, ast.Constant):
        return False
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and all(
        isinstance(element, ast.Constant) for element in node.elts
    ):
        return False
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in NOT_TEXT_CALLS
    ):
        return False
    segment = ast.get_source_segment(source, node) or ""
    if COUNTS.search(segment) and not re.search(r"\btext\b|stdout", segment):
        return False
    if re.search(r"\.(count|startswith|endswith|index)\(", segment):
        return False
    return bool(GENERATED.search(segment))


def unexplained_text_comparisons(source: str, name: str = "<source>") -> list[str]:
    """`file:line: code` for each == or != between two generated-looking expressions without a
    `same path:` comment on its line or the line above."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
            if not isinstance(op, (ast.Eq, ast.NotEq)):
                continue
            if not (_looks_generated(left, source) and _looks_generated(right, source)):
                continue
            nearby = lines[max(node.lineno - 2, 0) : node.lineno]
            if not any("same path:" in line for line in nearby):
                found.append(f"{name}:{node.lineno}: {lines[node.lineno - 1].strip()}")
            break
    return found


def test_no_test_compares_two_paths_texts_with_equality():
    found = []
    for path in sorted(TESTS.glob("*.py")):
        found += unexplained_text_comparisons(path.read_text(encoding="utf-8"), path.name)
    assert found == [], "compare through tests/neartie.py, or say why it is one path:\n" + (
        "\n".join(found)
    )


def test_the_check_sees_a_comparison_of_two_replies():
    source = 'def t(a, b):\n    assert a["text"] == b["text"]\n'
    assert unexplained_text_comparisons(source) == ['<source>:2: assert a["text"] == b["text"]']
    tokens = "def t(one, many):\n    assert [e.token for e in one] == [e.token for e in many]\n"
    assert len(unexplained_text_comparisons(tokens)) == 1
    explained = (
        "def t(a, b):\n    # same path: one run printed twice\n    assert a.stdout == b.stdout\n"
    )
    assert unexplained_text_comparisons(explained) == []
    counts = 'def t(a, b):\n    assert a["prompt_tokens"] == b["prompt_tokens"]\n'
    assert unexplained_text_comparisons(counts) == []

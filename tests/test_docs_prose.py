"""Prose cannot drift from the output it reads: a measured number stated beside a pasted block is
that block's number, or a ratio the test recomputes from two of them, or marked as coming from
elsewhere (scripts/refresh_docs.py re-pastes the blocks; this test says which prose then lies).

The rule, exactly, on every page of PAGES (PENDING ones are known to fail, and say so):

- A pasted block is a fenced block with a `$ ` command line in it (quill's, or a curl, jq, echo
  or sed beside it: refresh_docs.py pastes what each prints).
- The prose that reads it is the first paragraph after the block (its lines up to the next blank
  line, fence or heading; none when a heading or a fence comes first), and, while the paragraph
  taken last ends with a colon, the paragraph or list it introduces.
- That prose may quote the block, the pasted blocks right before it with nothing but blank lines
  between (a group read together), and, when it leads straight into another pasted block (blank
  lines only), that block too.
- A measured number is a number followed by a unit (tok/s, tokens/s, ms, s, MiB, GiB, GB/s, %,
  tokens, threads, cores, cells, ... see UNIT_NAMES; "prompt tokens" and the like count), a ratio
  written "1.98x", or each number of a list or range that ends in one ("132, 37 and 23 tokens/s",
  "14-33%", "104 against 115 MiB"), and a bare number right after one ("103 tokens/s against
  157"). Thousands separators are ignored; a number with no unit ("depth 4096") is not checked.
- Each must be a number of the blocks it reads (their command lines included), as written or
  rounded to the digits the prose writes ("103 tokens/s" for the block's 102.8 tok/s), in the same
  unit where the block gives one: "3.6 s" for the stats line's "TTFT 3557 ms" is a derived number,
  so quote "3557 ms".
- A ratio (x, times) or a percentage the blocks do not print is accepted when its own sentence
  (up to a period or semicolon) names two of their numbers whose quotient, or difference in
  percent, it is: "1.98x in prefill (1716.7 against 865.8 tok/s)", "27% slower (117.3 against
  159.7 tok/s)".
- Any other number (another run's, a constant of the code) is stated only where an HTML comment
  inside that prose lists it with its source, entries split by semicolons:
  `<!-- not from the block: 85% (an 8B model's run, benchmarks/README.md); 2 GiB (run
  --cache-max's default) -->`. An entry the prose no longer states is a problem too, so the
  comment cannot outlive its sentence.
"""

from __future__ import annotations

import itertools
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# reference.md is generated from --help (tests/test_docs.py keeps it so); guide.zh.md translates
# guide.md, whose prose this checks in English.
PAGES = [*sorted(p.name for p in (ROOT / "docs").glob("*.md")
                 if p.name not in ("reference.md", "guide.zh.md")), "README.md"]  # fmt: skip
# Pages whose prose still states numbers its blocks do not show: each test of them is an xfail
# (strict: once fixed, it passes, and the entry must go).
PENDING: dict[str, str] = {}

NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# Units, and the spelling each stands for.
UNIT_NAMES = {
    "tokens per second": "tok/s", "tokens/s": "tok/s", "tok/s": "tok/s", "t/s": "tok/s",
    "texts/s": "texts/s", "requests/s": "req/s", "req/s": "req/s",
    "MiB/s": "MiB/s", "GiB/s": "GiB/s", "MB/s": "MB/s", "GB/s": "GB/s",
    "bits per weight": "bpw", "bpw": "bpw",
    "seconds": "s", "second": "s", "ms": "ms", "µs": "µs", "s": "s",
    "KiB": "KiB", "MiB": "MiB", "GiB": "GiB", "TiB": "TiB", "EiB": "EiB",
    "KB": "KB", "MB": "MB", "GB": "GB", "TB": "TB", "bytes": "bytes", "%": "%", "times": "x",
    "tokens": "tok", "token": "tok", "tok": "tok", "cells": "cell", "cell": "cell",
    "threads": "thread", "thread": "thread", "cores": "core", "core": "core",
    "slots": "slot", "slot": "slot", "texts": "text", "text": "text",
}  # fmt: skip
UNIT = "|".join(re.escape(u) for u in sorted(UNIT_NAMES, key=len, reverse=True))
# A word that may stand between a number and "tokens": "41 prompt tokens".
QUALIFIER = r"(?:(?:prompt|new|cached|draft|generated|reply|decoded|more|fewer)\s+)?"
SEPARATOR = r"\s*(?:-|–|,|\bto\b|\bagainst\b|\band\b|\bor\b)\s*"
# A ratio's x is written against its number ("1.98x"); "512 x vocabulary" is a product.
MEASURED = re.compile(
    rf"(?<![\w.])(?P<numbers>(?:{NUM})(?:{SEPARATOR}(?:{NUM}))*)"
    rf"(?:(?P<times>[x×])|\s*{QUALIFIER}(?P<unit>{UNIT}))(?![\w/])"
)
# "103 tokens/s against 157": the second number is in the first one's unit.
CONTINUED = re.compile(rf"\s*(?:\bagainst\b|\bto\b)\s*(?P<number>{NUM})(?![\w.,]*\d)")
ANY_NUMBER = re.compile(rf"(?<![\w.])(?:{NUM})(?!\d)")
# In a block: a number, its "± spread", and the unit after it (or none).
BLOCK_NUMBER = re.compile(
    rf"(?<![\w.])(?P<number>\d+(?:\.\d+)?)(?![\d.]\d)(?:\s*±\s*\d+(?:\.\d+)?)?"
    rf"(?P<unit>\s*(?:{UNIT})(?![\w/]))?(?P<attached>[^\W\d]+)?"
)
THOUSANDS = re.compile(r"(?<![\w.,])\d{1,3}(?:,\d{3})+(?![\w,]?\d)")  # "134,515,008" in a block
LABEL_BEFORE = re.compile(r"(?:^|\W)(?P<unit>threads)\s+$")  # the stats line's "threads 2"
NOT_FROM_BLOCK = re.compile(r"<!--\s*not from the block:(.*?)-->", re.DOTALL)
RATIO_UNITS = {"x", "%"}


def canonical(unit: str) -> str:
    return "x" if unit in ("x", "×") else UNIT_NAMES[re.sub(r"\s+", " ", unit.strip())]


def value(text: str) -> tuple[float, int]:
    """A number as written: its value, and the digits after its point."""
    text = text.replace(",", "")
    return float(text), len(text.partition(".")[2])


def block_numbers(block: str) -> list[tuple[float, str | None]]:
    """Every number a block shows, with its unit (None: a bare number, a table cell)."""
    found: list[tuple[float, str | None]] = []
    for line in block.splitlines():
        for match in BLOCK_NUMBER.finditer(line):
            attached = match["attached"]
            if attached and attached not in (*UNIT_NAMES, "x"):
                continue  # "135m", "q4": part of a name, not a number
            unit = match["unit"] or attached
            if unit is None:
                label = LABEL_BEFORE.search(line[: match.start()])
                unit = label["unit"] if label else None
            found.append((float(match["number"]), canonical(unit) if unit else None))
        found += [(value(m.group())[0], None) for m in THOUSANDS.finditer(line)]
    return found


def shown_as(number: str, unit: str | None, numbers: list[tuple[float, str | None]]) -> bool:
    """Whether the prose's number is one of the block's, as written or rounded to the prose's
    digits, in the same unit where the block gives one."""
    wanted, digits = value(number)
    close = 0.5 * 10**-digits + 1e-9
    return any(
        abs(shown - wanted) <= close and (shown_unit is None or unit is None or shown_unit == unit)
        for shown, shown_unit in numbers
    )


def measured(prose: str) -> list[tuple[int, str, str]]:
    """(offset, number as written, canonical unit) of each measured number in the prose."""
    found = []
    for match in MEASURED.finditer(prose):
        unit = canonical(match["times"] or match["unit"])
        for number in ANY_NUMBER.finditer(match["numbers"]):
            found.append((match.start("numbers") + number.start(), number.group(), unit))
        more = CONTINUED.match(prose, match.end())
        if more and not MEASURED.match(prose, more.start("number")):
            found.append((more.start("number"), more["number"], unit))
    return found


def recomputed(number: str, unit: str, sentence: str, numbers: list) -> bool:
    """Whether a ratio or percentage is the quotient (or relative difference) of two of the
    block's numbers that its sentence names."""
    named = [value(n.group())[0] for n in ANY_NUMBER.finditer(sentence)
             if shown_as(n.group(), None, numbers) and value(n.group())[0] != 0]  # fmt: skip
    wanted, digits = value(number)
    for a, b in itertools.permutations(named, 2):
        candidates = [a / b] if unit == "x" else [a / b * 100, abs(a / b - 1) * 100]
        if any(abs(c - wanted) <= 0.5 * 10**-digits + 1e-9 for c in candidates):
            return True
    return False


def sentence_at(prose: str, offset: int) -> str:
    """The sentence (or the part between semicolons) around an offset of the prose."""
    starts = [0] + [m.end() for m in re.finditer(r"[.;!?]\s", prose) if m.end() <= offset]
    end = re.search(r"[.;!?]\s|$", prose[offset:])
    return prose[starts[-1] : offset + (end.end() if end else len(prose))]


def exemptions(prose: str) -> tuple[list[tuple[str, str, str]], list[str]]:
    """The numbers an HTML comment in the prose says do not come from the block: (number,
    unit, the whole entry); and the entries that do not parse."""
    entries, malformed = [], []
    for comment in NOT_FROM_BLOCK.finditer(prose):
        for entry in comment.group(1).split(";"):
            match = re.fullmatch(rf"\s*({NUM})\s*([x×]|{UNIT})\s+\((.+)\)\s*", entry, re.DOTALL)
            if match is None:
                malformed.append(entry.strip())
            else:
                entries.append((match[1], canonical(match[2]), entry.strip()))
    return entries, malformed


def hidden(prose: str) -> str:
    """The prose with its exemption comments blanked (offsets kept): what a reader sees."""
    return NOT_FROM_BLOCK.sub(lambda m: " " * len(m.group()), prose)


def is_fence(line: str) -> bool:
    return line.startswith("```")


def pasted_blocks(lines: list[str]) -> list[tuple[int, int]]:
    """(first line, closing fence) of each fenced block that shows a `$ ` command, 0-based."""
    blocks, index = [], 0
    while index < len(lines):
        if not is_fence(lines[index]):
            index += 1
            continue
        end = next(i for i in range(index + 1, len(lines)) if is_fence(lines[i]))
        if any(line.startswith("$ ") for line in lines[index + 1 : end]):
            blocks.append((index + 1, end))
        index = end + 1
    return blocks


def prose_after(lines: list[str], end: int) -> tuple[int, list[str], int | None]:
    """The prose that reads the block closing at `end`: (its first line, its lines from there
    on, blank ones between its paragraphs kept, the line of the next fence when the prose leads
    straight into it, else None)."""
    index, taken, first = end + 1, [], end + 1
    while True:
        gap = index
        while index < len(lines) and not lines[index].strip():
            index += 1
        if index == len(lines) or lines[index].startswith("#"):
            return first, taken, None
        if is_fence(lines[index]):
            return first, taken, index
        if taken:
            taken += lines[gap:index]
        else:
            first = index
        while index < len(lines) and lines[index].strip() and not is_fence(lines[index]):
            taken.append(lines[index])
            index += 1
        if not taken[-1].rstrip().endswith(":"):
            while index < len(lines) and not lines[index].strip():
                index += 1
            return first, taken, index if index < len(lines) and is_fence(lines[index]) else None


def blank(lines: list[str], start: int, end: int) -> bool:
    return all(not line.strip() for line in lines[start:end])


def readings(lines: list[str]) -> list[tuple[int, int, str, list]]:
    """For each pasted block: (its first line, the first line of its prose, 0-based; the prose;
    the numbers it may state: the block's, those of pasted blocks right before it (nothing but
    blank lines between: one group), and those of the next when the prose leads into it)."""
    blocks = pasted_blocks(lines)
    found = []
    for number, (start, end) in enumerate(blocks):
        first, taken, next_fence = prose_after(lines, end)
        shown = list(lines[start:end])
        earlier = number
        while earlier > 0 and blank(lines, blocks[earlier - 1][1] + 1, blocks[earlier][0] - 1):
            earlier -= 1
            shown += lines[blocks[earlier][0] : blocks[earlier][1]]
        following = [b for b in blocks if b[0] == (next_fence or -2) + 1]
        if taken and following:
            shown += lines[following[0][0] : following[0][1]]
        found.append((start, first, "\n".join(taken), block_numbers("\n".join(shown))))
    return found


def accepted(number: str, unit: str, prose: str, offset: int, numbers: list) -> bool:
    """Whether the rule allows a measured number where it stands (exemptions aside)."""
    if shown_as(number, unit, numbers):
        return True
    return unit in RATIO_UNITS and recomputed(number, unit, sentence_at(prose, offset), numbers)


def problems(path: Path) -> list[str]:
    """Each measured number in the prose beside a pasted block that the rule does not allow."""
    found = []
    for start, first, prose, numbers in readings(path.read_text(encoding="utf-8").splitlines()):
        entries, malformed = exemptions(prose)
        found += [f"{path.name}:{first + 1}: unreadable exemption {e!r}" for e in malformed]
        visible = hidden(prose)
        stated = measured(visible)
        for number, unit, entry in entries:
            if not any(value(n) == value(number) and u == unit for _, n, u in stated):
                found.append(f"{path.name}:{first + 1}: the prose no longer states {entry!r}")
        for offset, number, unit in stated:
            exempt = any(value(n) == value(number) and u == unit for n, u, _ in entries)
            if not exempt and not accepted(number, unit, visible, offset, numbers):
                line = first + 1 + visible[:offset].count("\n")
                found.append(
                    f"{path.name}:{line}: {number} {unit} is not in the block at :{start} "
                    "(quote the block's figure, name the two it is a ratio of, or say where it "
                    "comes from: <!-- not from the block: NUMBER UNIT (source) -->)"
                )
    return found


def page_path(name: str) -> Path:
    return ROOT / name if name == "README.md" else ROOT / "docs" / name


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.xfail(reason=PENDING[p], strict=True))
     if p in PENDING else p for p in PAGES],
)  # fmt: skip
def test_prose_beside_a_block_states_only_its_numbers(page):
    assert problems(page_path(page)) == []


def test_the_check_reads_many_blocks_and_numbers():
    """A parse that found no blocks or no numbers would pass every page without reading it."""
    read = [r for page in PAGES for r in readings(page_path(page).read_text().splitlines())]
    assert len(read) >= 100
    assert sum(len(measured(hidden(prose))) for _, _, prose, _ in read) >= 100
    assert set(PENDING) <= set(PAGES)


def _page(tmp_path: Path, prose: str, block: str = "") -> Path:
    block = block or (
        '$ quill run -n 24 "Hi"\nHello.\nload 0.16 s · TTFT 3557 ms · prefill 1360 tok, '
        "383.2 tok/s · decode 24 tok, 102.8 tok/s · threads 2"
    )
    path = tmp_path / "page.md"
    # The second paragraph is not the prose that reads the block: its number is not checked.
    path.write_text(f"# Page\n\n```text\n{block}\n```\n\n{prose}\n\nLater prose: 99 ms.\n")
    return path


@pytest.mark.parametrize(
    ("prose", "flagged"),
    [
        ("1,360 prompt tokens took 3557 ms; decode ran at 103 tokens/s on 2 threads.", []),
        ("The first token took 3.6 s.", ["3.6 s"]),  # derived from 3557 ms: quote the block
        ("Decode ran at 104 tokens/s.", ["104 tok/s"]),
        ("quill used 1 thread.", ["1 thread"]),
        ("Prefill beat decode 3.73x (383.2 against 102.8 tok/s).", []),
        ("Prefill beat decode 3.9x (383.2 against 102.8 tok/s).", ["3.9 x"]),
        ("Prefill beat decode 3.73x.", ["3.73 x"]),  # the operands must be named
        ("Between 90 and 102.8 tok/s.", ["90 tok/s"]),  # each number of a list
        ("It reached 85%. <!-- not from the block: 85% (another run) -->", []),
        ("It reached 86%. <!-- not from the block: 85% (another run) -->", ["85%", "86 %"]),
        ("It reached 85%. <!-- not from the block: 85% -->", ["unreadable", "85 %"]),  # no source
        ("At depth 4096, turn 10: no unit, not a measurement.", []),
        ("How to read it:\n\n- Decode: 120 tok/s.", ["120 tok/s"]),  # the list it introduces
        ("Decode ran at 102.8 tokens/s against 157.", ["157 tok/s"]),  # the unit carries on
        ("A batch of 512 x vocabulary x 4 bytes.", ["4 bytes"]),  # a product, not a ratio
        ("Not 3557 ms: 3.5 s. <!-- not from the block: 3.5 s (a faster run) -->", []),
    ],
)
def test_the_rule_on_one_block(tmp_path, prose, flagged):
    found = problems(_page(tmp_path, prose))
    assert len(found) == len(flagged), found
    for problem, number in zip(found, flagged, strict=True):
        assert number in problem, (problem, number)


def test_prose_between_two_blocks_reads_both(tmp_path):
    path = _page(tmp_path, "Now a longer prompt, 5000 ms to the first token:\n\n```text\n"
                 "$ quill run \"Hello\"\nload 0.1 s · TTFT 5000 ms\n```\n\n## Next")  # fmt: skip
    assert problems(path) == []
    path.write_text(path.read_text().replace("5000 ms to", "5001 ms to"))
    assert len(problems(path)) == 1


def test_blocks_pasted_one_after_another_are_read_together(tmp_path):
    group = "$ quill bench big\ntg64: 68.2 tok/s\n```\n\n```text\n$ quill bench\ntg64: 169.3 tok/s"
    path = _page(tmp_path, "68.2 against 169.3 tokens/s.", group)
    assert problems(path) == []
    path.write_text(path.read_text().replace("68.2 against", "68.3 against"))
    assert len(problems(path)) == 1


@pytest.mark.parametrize("page", [p for p in PAGES if p not in PENDING])
def test_editing_any_checked_number_fails(tmp_path, page):
    """Every measured number a page states beside a block, edited one at a time in a copy of the
    page (to the nearest value the rule does not accept there), makes the check fail: no number
    escapes the check by the way it is written."""
    path = Path(shutil.copy(page_path(page), tmp_path / page))
    original = path.read_text(encoding="utf-8")
    lines = original.splitlines(keepends=True)
    for _, first, prose, numbers in readings(original.splitlines()):
        visible = hidden(prose)
        for offset, number, unit in measured(visible):
            wanted, digits = value(number)
            other = next(
                text for k in itertools.count(1)
                if not accepted(text := f"{wanted + k * 10**-digits:.{digits}f}", unit,
                                visible[:offset] + text + visible[offset + len(number):],
                                offset, numbers)
            )  # fmt: skip
            at = sum(len(line) for line in lines[:first]) + offset
            assert original[at : at + len(number)] == number
            path.write_text(original[:at] + other + original[at + len(number) :], encoding="utf-8")
            assert problems(path), f"{page}: {number} {unit} edited to {other} at :{first + 1}"
    path.write_text(original, encoding="utf-8")
    assert problems(path) == []

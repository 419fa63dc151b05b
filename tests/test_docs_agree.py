"""Docs that cannot disagree with themselves: a command shown twice shows the same output (its
measured numbers aside), every page that pastes output names the one run it came from
(scripts/refresh_docs.py writes that line, and the output, in one go), and pages that show the
same command come from the same run."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from test_docs import DOCS, ROOT, quill_commands, shown_reply

from scripts.refresh_docs import MACHINE_PREFIX

# The same command line, shown twice on purpose in two different states.
STATEFUL = {"quill pull smollm2-135m": "the first pull downloads the model, the second finds it"}
BUSY = re.compile(r" \(\d+ cores? busy elsewhere\)")  # how loaded the machine was at that second
PROGRESS = re.compile(r"^tensors: \d+/\d+ .*$\n?", re.MULTILINE)  # printed every so often
BARS = re.compile(r"[█▌]+")  # a bar's length is a measured number (and 0 has none)


def skeleton(text: str) -> str:
    """The text with what a run measures (numbers, bars, busy cores, progress) blanked and
    columns closed up: what two runs of one command on one machine print alike."""
    text = PROGRESS.sub("", BUSY.sub("", text))
    text = BARS.sub("", re.sub(r"\d+(?:\.\d+)?", "#", text))
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())


def deterministic(argv: list[str]) -> bool:
    """Whether the reply is fixed: greedy or seeded (anything but run and chat has no reply)."""
    if argv[:1] not in (["run"], ["chat"]) or "--seed" in argv:
        return True
    flags = [i for i, arg in enumerate(argv) if arg in ("--temperature", "--temp")]
    return any(float(argv[i + 1]) == 0 for i in flags if i + 1 < len(argv))


def shows_reply(typed: str) -> bool:
    """Whether the command line leaves stdout, the reply, on the page (`2>&1 >/dev/null` and
    `>/dev/null` drop it; `2>/dev/null` drops stderr only)."""
    return re.search(r"(?<![0-9&])>\s*/dev/null", typed) is None


def besides_reply(shown: str) -> str:
    """quill's own lines around a reply: its messages and the stats line on."""
    lines = shown.splitlines()
    stats = next((i for i, line in enumerate(lines)
                  if line.startswith("load ") and " TTFT " in line), len(lines))  # fmt: skip
    return "\n".join([line for line in lines[:stats] if line.startswith("quill:")] + lines[stats:])


def excerpt_agrees(one: str, other: str) -> bool:
    """A block that shows `...` shows part of the output: its lines must be in the other's."""
    part, whole = (one, other) if "..." in one.splitlines() else (other, one)
    return set(part.splitlines()) - {"..."} <= set(whole.splitlines())


def disagreements(paths: list[Path]) -> list[str]:
    """Every command line shown twice or more whose outputs differ where a run on one machine
    decides them: the reply of a greedy or seeded run exactly, and the rest but its numbers."""
    shown_by_line: dict[str, list[tuple[str, str, list[str]]]] = {}
    texts = {path.name: path.read_text(encoding="utf-8").splitlines() for path in paths}
    for doc, line, argv, shown, _plain in quill_commands(paths):
        typed = texts[doc][line - 1][2:]
        if shown.strip() and "--help" not in argv and typed not in STATEFUL:
            shown_by_line.setdefault(typed, []).append((f"{doc}:{line}", shown, argv))
    problems = []
    for typed, shown in shown_by_line.items():
        (first, first_text, argv), *others = shown
        for where, text, _ in others:
            # one run on one machine pasted both, as the pages' machine line says
            if argv[:1] in (["run"], ["chat"]) and deterministic(argv) and shows_reply(typed):
                same = shown_reply(text) == shown_reply(first_text)  # same path: one run
                same = same and skeleton(text) == skeleton(first_text)  # same path: one run
            elif deterministic(argv):
                same = skeleton(text) == skeleton(first_text)  # same path: one run
            else:  # a sampled reply differs by design; the rest must agree (same path: one run)
                same = skeleton(besides_reply(text)) == skeleton(besides_reply(first_text))
            if not same and "..." in (text + "\n" + first_text).splitlines():
                same = excerpt_agrees(skeleton(text), skeleton(first_text))
            if not same:
                problems.append(f"{where} and {first} show different output for: {typed[:80]}")
    return problems


def machine_lines(paths: list[Path]) -> dict[str, list[str]]:
    """Each page that pastes output (a `$ ` line with lines under it): its machine lines."""
    found = {}
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        pastes = any(
            line.startswith("$ ") and index + 1 < len(lines)
            and not lines[index + 1].startswith(("$ ", "```"))
            for index, line in enumerate(lines)
        )  # fmt: skip
        if pastes:
            found[path.name] = [line for line in lines if line.startswith(MACHINE_PREFIX)]
    return found


def machine_problems(paths: list[Path]) -> list[str]:
    """Each page names the one run its output came from; pages that show the same command name
    the same run (their outputs are compared, so they must come from one machine and day). A
    page whose commands no other page shows may come from a run of its own."""
    found = machine_lines(paths)
    problems = [f"{page} names its machine {len(lines)} times, not once"
                for page, lines in found.items() if len(lines) != 1]  # fmt: skip
    runs = {page: lines[0] for page, lines in found.items() if len(lines) == 1}
    pages_of: dict[str, set[str]] = {}
    for doc, _, argv, _, _ in quill_commands(paths):
        pages_of.setdefault(" ".join(argv), set()).add(doc)
    for command, pages in sorted(pages_of.items()):
        named = sorted({runs[page] for page in pages if page in runs})
        if len(named) > 1:
            problems.append(
                f"{', '.join(sorted(pages))} show `quill {command}` from different runs "
                "(python scripts/refresh_docs.py re-pastes them all): " + " | ".join(named)
            )
    return problems


def test_a_command_shown_twice_shows_the_same_output():
    assert disagreements(DOCS) == []


def test_every_page_names_its_run_and_pages_showing_one_command_share_it():
    found = machine_lines(DOCS)
    assert {"guide.md", "run.md", "serve.md", "README.md"} <= set(found)
    assert machine_problems(DOCS) == []
    assert (
        "quill " in next(iter(found.values()))[0]
        and "llama-cpp-python" in (next(iter(found.values()))[0])
    )


def _page(tmp_path: Path, name: str, *blocks: str) -> Path:
    path = tmp_path / name
    path.write_text(f"# {name}\n\n{MACHINE_PREFIX} from one run on X.\n\n```text\n"
                    + "\n".join(blocks) + "\n```\n")  # fmt: skip
    return path


def test_a_disagreeing_pair_fails(tmp_path):
    """Copies of real pages, one example edited: the check must name it."""
    guide, troubleshooting = (ROOT / "docs" / "guide.md"), (ROOT / "docs" / "troubleshooting.md")
    copies = [Path(shutil.copy(page, tmp_path / page.name)) for page in (guide, troubleshooting)]
    assert disagreements(copies) == []
    seeded = next(c for c in quill_commands(copies) if "--seed" in c[2] and c[0] == "guide.md")
    text = copies[0].read_text(encoding="utf-8").splitlines()
    text[seeded[1]] = text[seeded[1]].replace(text[seeded[1]].split()[0], "Tax", 1)
    copies[0].write_text("\n".join(text), encoding="utf-8")
    assert any("different output" in problem for problem in disagreements(copies))

    greedy = 'quill run --temperature 0 -n 4 "Hi"'
    stats = "load 0.2 s · TTFT {} ms · prefill 30 tok · finish length · threads 2"
    busy = stats.format(120) + " (1 core busy elsewhere)"
    timings = _page(tmp_path, "timings.md", f"$ {greedy}", "Hello!", stats.format(90),
                    f"$ {greedy}", "Hello!", busy)  # fmt: skip
    assert disagreements([timings]) == []  # numbers and load are measured: they may differ
    reply = _page(tmp_path, "reply.md", f"$ {greedy}", "Hello!", stats.format(90),
                  f"$ {greedy}", "Hi!", stats.format(90))  # fmt: skip
    assert len(disagreements([reply])) == 1
    stop = _page(tmp_path, "stop.md", f"$ {greedy}", "Hello!", stats.format(90),
                 f"$ {greedy}", "Hello!", stats.format(90).replace("length", "stop"))  # fmt: skip
    assert len(disagreements([stop])) == 1
    sampled = 'quill run -n 4 "Hi"'
    free = _page(tmp_path, "free.md", f"$ {sampled}", "Hello!", stats.format(90),
                 f"$ {sampled}", "Hey there", stats.format(80))  # fmt: skip
    assert disagreements([free]) == []  # a sampled reply may differ, its stats may not
    assert len(
        disagreements(
            [
                _page(
                    tmp_path,
                    "free2.md",
                    f"$ {sampled}",
                    "Hello!",
                    stats.format(90),
                    f"$ {sampled}",
                    "Hey",
                    "quill: error: x",
                )
            ]
        )
    )


def test_pages_from_two_runs_fail_where_they_show_one_command(tmp_path):
    first = _page(tmp_path, "a.md", "$ quill list", "NAME")
    second = tmp_path / "b.md"
    second.write_text(first.read_text().replace("on X.", "on Y."))
    assert machine_problems([first]) == []
    assert len(machine_problems([first, second])) == 1
    other = tmp_path / "c2.md"
    other.write_text(first.read_text().replace("on X.", "on Y.").replace("quill list", "quill ps"))
    assert machine_problems([first, other]) == []  # nothing shown on both: a run of its own
    unnamed = tmp_path / "c.md"
    unnamed.write_text(first.read_text().replace(MACHINE_PREFIX, "Pasted"))
    assert machine_problems([first, unnamed]) == ["c.md names its machine 0 times, not once"]


def test_the_guide_quotes_the_reply_it_shows():
    """Section 9 quotes section 1's greedy reply: the quote must be how that reply starts."""
    guide = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
    quoted = re.search(r'prints "(.+?) \.\.\." on the AMD EPYC', guide.replace("\n", " "))
    assert quoted is not None
    command = 'quill run --temperature 0 -n 24 "Explain in one sentence what a KV cache is."'
    shown = next(s for d, n, _, s, _ in quill_commands([ROOT / "docs" / "guide.md"])
                 if guide.splitlines()[n - 1] == f"$ {command}")  # fmt: skip
    assert shown_reply(shown).startswith(quoted[1])

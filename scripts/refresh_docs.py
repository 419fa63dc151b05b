"""Run every `$ ...` example of docs/ and the README again and paste what it prints now, so that
each page's output comes from one run on one machine, which it names in one line (pages that show
one command must come from one run: tests/test_docs_agree.py; run them all together).

Usage: python scripts/refresh_docs.py [--help-blocks] [PAGE ...]
  --help-blocks  paste today's `quill ... --help` only: no model runs, seconds (after changing
                 an option; tests/test_docs.py::test_pasted_help_is_current fails until then)
  PAGE           only these pages (guide.md, README.md, ...): for trying the script; their machine
                 line then differs from the others', which tests/test_docs_agree.py refuses

Each page runs in a quill home of its own at /tmp/qdoc holding only the default model (as after
the README's first run) and any model its EXTRA_MODELS entry names (both copied from your own
quill home: pull them there first), in a scratch folder with the files the page uses (FIXTURES,
and any file the page shows with `$ cat FILE`), its examples in page order, `rm` last. stdout
and stderr go to one pipe, in the order a terminal shows them; a plain `quill run --json` is
shown indented. A `$ quill serve` starts that server on a free port of 127.0.0.1 (the page's
port is written back into what is pasted); its block gets the server's log when the next server
for its port starts or the page ends (then SIGTERM). guide.zh.md, a translation, shows
guide.md's output of each command the two share. Each example first waits for a quiet machine
(WAIT_S, WAIT_BUDGET_S), so that quill picks the same threads for all. Timings are pasted as
they come; read the prose around them after a run.
SKIP names what is not run here, and why: those blocks keep the output of an earlier run.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "reference.md"),
         ROOT / "README.md"]  # fmt: skip
HOME = Path("/tmp/qdoc")  # the path the pasted output shows
HELP_LINE = re.compile(r"^\$ quill (.*)--help$")
MACHINE_PREFIX = "Output on this page: pasted by `scripts/refresh_docs.py`"
TRANSLATIONS = {"guide.zh.md": "guide.md"}  # a translation shows its original's output
SKIP = {  # a part of the command line: why it is not run here
    "someone/": "needs a Hub: shown from a run against tests/hubserver.py, a local stand-in",
    "gemma3-270m": "needs Gemma 3 270M, a 240 MB download from the package index",
    "Hi there": "a first run on a machine without the model: downloads from the package index",
    "Tell me about the sea": "shows a run beside a busy process started for the purpose",
    "--rpc": "needs quill rpc-server on the ports it names, and scale.md stops one mid-run",
    "quill rpc-server": "serves until stopped",
    "10.0.0.": "a load balancer on another machine",
    "quill pull all-minilm-l6-v2": "the first pull downloads and converts; the page home has it",
}
# The first of two equal commands on a page, when only the first is not run here.
SKIP_FIRST = {"quill pull smollm2-135m": "the first pull downloads from the package index"}
LONG = ("quill bench ", "quill quant-report ")  # minutes each: one run serves every page
PICTURES = {"bench.png": ROOT / "docs/img/bench-smollm2.png"}  # drawn by an example, shown as is


def _write_tiny(path: Path, home: Path) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tinymodel import write_tiny_llama

    write_tiny_llama(path)


def _write_cut(path: Path, home: Path) -> None:
    """The default model cut after 1 MiB: the header reads, the tensor data is missing."""
    with open(home / "models/smollm2-135m/q4_1/SmolLM2-135M-Instruct.Q4_1.gguf", "rb") as model:
        path.write_bytes(model.read(1 << 20))


# Files the pages use without showing them: name -> the pages that use it, how it is made
# (from its path and the quill home).
FIXTURES = {
    "notes.gguf": (("run.md", "troubleshooting.md"),
                   lambda p, _: p.write_text("hello, these are my notes\n")),
    "cut.gguf": (("run.md", "troubleshooting.md"), _write_cut),
    "tiny.gguf": (("troubleshooting.md",), _write_tiny),
    "/tmp/loop.jinja": (("troubleshooting.md",), lambda p, _: p.write_text(
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}")),
    "invoice.txt": (("run.md",), lambda p, _: p.write_text(
        "ACME Corporation\nInvoice date: 03/04/2024\nTotal: 1234.50\n")),
    "my-model.gguf": (("models.md",), lambda p, _: p.write_bytes(b"GGUF")),
    "person.json": (("run.md",), lambda p, _: p.write_text(json.dumps({
        "type": "object",
        "properties": {
            "name": {"type": "string"}, "born": {"type": "string", "format": "date"},
            "height_cm": {"type": "integer", "minimum": 50, "maximum": 250},
            "languages": {"type": "array", "items": {"type": "string"}},
            "email": {"type": "string", "format": "email"},
        },
        "required": ["name", "born", "height_cm", "languages", "email"],
    }))),
}  # fmt: skip


def environment() -> dict[str, str]:
    """The pages' environment: plain output 100 columns wide, no package index, and OpenMP as
    users have it (OMP_WAIT_POLICY as the caller's: passive makes 2-thread decode ~2x slower)."""
    bin_dir = str(Path(sys.executable).parent)
    return dict(
        os.environ, QUILL_HOME=str(HOME), COLUMNS="100", NO_COLOR="1", TERM="dumb",
        PIP_NO_INDEX="1", PATH=bin_dir + os.pathsep + os.environ["PATH"],
    )  # fmt: skip


def current_help(args: list[str]) -> list[str]:
    quill = Path(sys.executable).with_name("quill")
    text = subprocess.run(
        [str(quill), *args, "--help"], capture_output=True, text=True, env=environment(),
        check=True,
    ).stdout  # fmt: skip
    return [line.rstrip() for line in text.rstrip("\n").split("\n")]


def shown_lines(lines: list[str], index: int) -> int:
    """The line after the output shown below the command at lines[index]."""
    end = index + 1
    while end < len(lines) and not lines[end].startswith(("$ ", "```")):
        end += 1
    return end


def help_blocks(lines: list[str]) -> list[tuple[int, int, list[str]]]:
    """(first line of the pasted help, the line after it, the arguments before --help)."""
    return [(index + 1, shown_lines(lines, index), match[1].split())
            for index, line in enumerate(lines) if (match := HELP_LINE.match(line))]  # fmt: skip


def machine_line() -> str:
    """The machine, the versions and the day, in one sentence."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    cores = len(set(re.findall(r"^physical id\s*:\s*(\d+)\n(?:.*\n)*?core id\s*:\s*(\d+)",
                               cpuinfo, re.MULTILINE))) or os.cpu_count()  # fmt: skip
    kib = int(re.search(r"MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text())[1])
    system = re.search(r'^PRETTY_NAME="(.+)"', Path("/etc/os-release").read_text(), re.MULTILINE)
    from cli.engine.hardware import ANY_GPU, gpu_memory

    # As quill itself judges (options.resolve_gpu_layers): an RPC build's
    # llama_supports_gpu_offload() says yes on a machine without a GPU.
    gpus = [name for name, _ in gpu_memory(ANY_GPU)]
    gpu = ", ".join(gpus) if gpus else "no GPU"
    return (
        f"{MACHINE_PREFIX} from one run on {model[1] if model else platform.processor()} "
        f"({cores} cores, {kib / 2**20:.1f} GiB of memory, {gpu}), "
        f"{system[1] if system else platform.platform()}, "
        f"quill {importlib.metadata.version('quill-llm')}, "
        f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}, "
        f"OMP_WAIT_POLICY={environment().get('OMP_WAIT_POLICY', 'unset (OpenMP default)')}, "
        f"on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}. Examples it cannot run here "
        "(its SKIP list says why) keep the output of an earlier run."
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A `quill serve` of the page, on a free port, its log kept as it comes."""

    def __init__(self, command: str, workdir: Path, env: dict[str, str]) -> None:
        argv = shlex.split(command)
        self.page_port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8080
        self.port = free_port()
        typed = re.sub(r"\s--port \d+", "", command) + f" --port {self.port}"
        self.process = subprocess.Popen(
            ["bash", "-c", typed], cwd=workdir, env=env, text=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.log: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180):
            self.stop()
            raise SystemExit(f"{command} did not start: {self.log}")

    def _read(self) -> None:
        for line in self.process.stdout:
            self.log.append(self.page_side(line.rstrip("\n")))
            if "Ctrl-C to stop" in line:
                self.ready.set()
        self.ready.set()

    def our_side(self, text: str) -> str:
        return text.replace(f"127.0.0.1:{self.page_port}", f"127.0.0.1:{self.port}")

    def page_side(self, text: str) -> str:
        return text.replace(f"127.0.0.1:{self.port}", f"127.0.0.1:{self.page_port}")

    def stop(self) -> list[str]:
        os.killpg(self.process.pid, signal.SIGTERM)
        self.process.wait(60)
        time.sleep(0.2)  # the reader's last lines
        return self.log


def fresh_home(models: list[Path]) -> None:
    """A quill home holding only the default model, as the README's first run leaves it, and
    the page's EXTRA_MODELS: each file, and its manifest entry, as in the user's own home."""
    shutil.rmtree(HOME, ignore_errors=True)
    entries = []
    for model in models:
        own_home = model.parents[3]  # models/ALIAS/TAG/FILE under the user's quill home
        target = HOME / model.relative_to(own_home)
        target.parent.mkdir(parents=True)
        shutil.copy(model, target)
        manifest = json.loads((own_home / "manifest.json").read_text())
        entry = next(e for e in manifest["downloads"] if e["path"] == str(model))
        entries.append({**entry, "path": str(target)})
    (HOME / "manifest.json").write_text(json.dumps({"downloads": entries}))


DEFAULT_MODEL = "smollm2-135m:q4_1"
# Models a page's examples need beside the default one, as `quill list` names them: copied from
# the user's own quill home (`quill pull ALIAS` there first), as the default model is.
EXTRA_MODELS = {"embeddings.md": ("all-minilm-l6-v2:f16",)}


def own_model(name: str) -> Path:
    """Where the model NAME (as `quill list` names it) lies in the user's own quill home: one
    fetched from the package index, so that it lies under that home's models/ as a page's home
    keeps it."""
    env = environment()
    env.pop("QUILL_HOME")
    env.update({"QUILL_HOME": os.environ["QUILL_HOME"]} if "QUILL_HOME" in os.environ else {})
    listed = subprocess.run(
        ["quill", "list", "--json"], capture_output=True, text=True, check=True, env=env
    )
    for entry in json.loads(listed.stdout):
        if entry["name"] == name and entry["source"] == "pypi":
            return Path(entry["path"])
    what = "the default model" if name == DEFAULT_MODEL else f"{name} (the docs use it)"
    raise SystemExit(f"{what} is not on disk: quill pull {name.split(':')[0]}")


def excerpt(old: list[str], new: list[str]) -> list[str] | None:
    """A block that shows `...` or `(... what is left out ...)` shows part of the output: the
    same part of the new output. The lines before the mark come from its start; those after
    `...` from the line with the same label, those after `(...)` from its end."""
    cut = next(i for i, line in enumerate(old) if line == "..." or line.startswith("(..."))
    head, tail = old[:cut], old[cut + 1 :]
    if old[cut] != "...":
        return [*new[: len(head)], old[cut], *new[len(new) - len(tail) :]]
    if not tail:
        return [*new[: len(head)], "..."]
    label = re.split(r"\s{2,}", tail[0].strip())[0]
    start = next((i for i, line in enumerate(new) if line.strip().startswith(label)), None)
    if start is None:
        return None
    return [*new[: len(head)], "...", *new[start : start + len(tail)]]


def busy_cores(seconds: float = 0.5) -> float:
    """How many cores' worth of CPU time the machine spent outside idle over `seconds`."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    (idle0, all0), _ = sample(), time.sleep(seconds)
    idle1, all1 = sample()
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(all1 - all0, 1))


WAITS: list[float] = []  # seconds each example waited for a quiet machine
WAIT_S, WAIT_BUDGET_S = 30, 420  # at most, for one example and for the whole run


def wait_until_idle() -> None:
    """quill leaves out the cores other work keeps busy, and 1 thread can sum in another order
    than 2: so that the examples run alike, each waits for a quiet machine (within limits)."""
    start = time.monotonic()
    limit = min(WAIT_S, WAIT_BUDGET_S - sum(WAITS))
    while busy_cores() > 0.3 and time.monotonic() - start < limit:
        pass
    WAITS.append(time.monotonic() - start)


def run_command(command: str, workdir: Path, env: dict[str, str], servers: dict) -> tuple:
    for server in servers.values():
        command = server.our_side(command)
    result = subprocess.run(
        ["bash", "-c", command], cwd=workdir, env=env, text=True, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1800,
    )  # fmt: skip
    text = result.stdout
    for server in servers.values():
        text = server.page_side(text)
    return result.returncode, [line.rstrip() for line in text.rstrip("\n").split("\n") if text]


def indented_json(command: str, output: list[str]) -> list[str]:
    """A plain `quill run --json` prints one line; the page shows it indented."""
    argv = shlex.split(command)
    plain = not {"|", ">", "2>&1", ">/dev/null"} & set(argv)
    if argv[:2] != ["quill", "run"] or "--json" not in argv or not plain or not output:
        return output
    try:
        document = json.loads(output[0])
    except ValueError:
        return output
    return [*json.dumps(document, indent=4, ensure_ascii=False).split("\n"), *output[1:]]


def make_page_files(page: str, workdir: Path, home: Path) -> None:
    """The folder a page's examples run in: the checkout's tests/ (for the templates the guide
    names) and the FIXTURES the page uses."""
    (workdir / "tests").symlink_to(ROOT / "tests")
    for name, (pages, make) in FIXTURES.items():
        if page in pages:
            make(workdir / name if not name.startswith("/") else Path(name), home)


def make_fixtures(lines: list[str], workdir: Path, index: int, servers: dict) -> None:
    """The files a command at lines[index] reads that the page shows: after `$ cat FILE`, or,
    for `$ python FILE.py`, the python block above it."""
    argv = lines[index][2:].split() if lines[index].startswith("$ ") else []
    if argv[:1] == ["cat"] and len(argv) == 2:
        shown = lines[index + 1 : shown_lines(lines, index)]
        (workdir / argv[1]).write_text("\n".join(shown) + "\n")
    if argv[:1] == ["python"] and len(argv) == 2:
        opening = max(i for i in range(index) if lines[i].startswith("```python"))
        closing = next(i for i in range(opening + 1, len(lines)) if lines[i].startswith("```"))
        text = "\n".join(lines[opening + 1 : closing]) + "\n"
        for server in servers.values():
            text = server.our_side(text)
        (workdir / argv[1]).write_text(text)


def refresh_page(path: Path, models: dict, outputs: dict, skipped: list[str]) -> None:
    """Run the page's examples and paste their output; outputs keeps each page's by command."""
    page = path.name
    lines = path.read_text(encoding="utf-8").split("\n")
    commands = [(i, line[2:]) for i, line in enumerate(lines) if line.startswith("$ ")]
    original = outputs.get(TRANSLATIONS.get(page, ""), {})
    mine: dict[str, list[list[str]]] = {}
    fresh_home([models[name] for name in (DEFAULT_MODEL, *EXTRA_MODELS.get(page, ()))])
    pasted: dict[int, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="qdoc-page-") as scratch:
        workdir = Path(scratch)
        make_page_files(page, workdir, HOME)
        env = environment()
        servers: dict[int, Server] = {}
        codes: dict[int, int] = {}
        seen: set[str] = set()
        order = sorted(commands, key=lambda c: c[1].startswith("quill rm "))
        for index, command in order:
            argv = command.split()
            old = lines[index + 1 : shown_lines(lines, index)]
            make_fixtures(lines, workdir, index, servers)
            if command == "echo $?":
                previous = max(i for i, _ in commands if i < index)
                pasted[index] = [str(codes[previous])] if previous in codes else old
                continue
            if "quill" not in argv and argv[0] not in ("curl", "python"):
                continue  # `cat FILE` shows a file the page uses
            if HELP_LINE.match(lines[index]):
                pasted[index] = current_help(HELP_LINE.match(lines[index])[1].split())
                continue
            why = next((w for key, w in SKIP.items() if key in command), None)
            if command in SKIP_FIRST and command not in seen:
                why = SKIP_FIRST[command]
            seen.add(command)
            if why:
                skipped.append(f"{page}:{index + 1} {command[:60]}: {why}")
                continue
            if original.get(command) or command in outputs["long"]:
                if original.get(command):
                    codes[index], pasted[index] = original[command].pop(0)
                else:
                    codes[index], pasted[index] = outputs["long"][command]
                mine.setdefault(command, []).append((codes[index], pasted[index]))
                continue
            print(f"{page}:{index + 1} $ {command[:90]}", file=sys.stderr, flush=True)
            if argv[:2] == ["quill", "serve"]:
                server = Server(command, workdir, env)
                if server.page_port in servers:
                    ended = servers.pop(server.page_port)
                    pasted[ended.line] = ended.stop()
                server.line = index
                servers[server.page_port] = server
                continue
            wait_until_idle()
            codes[index], output = run_command(command, workdir, env, servers)
            for name, shown in PICTURES.items():
                if name in argv and (workdir / name).exists():
                    shutil.copy(workdir / name, shown)
            output = indented_json(command, output)
            if any(line == "..." or line.startswith("(...") for line in old):
                output = excerpt(old, output) or old
            pasted[index] = output
            mine.setdefault(command, []).append((codes[index], output))
            if command.startswith(LONG):
                outputs["long"][command] = (codes[index], output)
        for server in servers.values():
            pasted[server.line] = server.stop()
    for index in sorted(pasted, reverse=True):
        lines[index + 1 : shown_lines(lines, index)] = pasted[index]
    outputs[page] = mine
    path.write_text("\n".join(lines), encoding="utf-8")


def paste_machine_line(paths: list[Path]) -> None:
    line = machine_line()
    for path in paths:
        text = path.read_text(encoding="utf-8")
        marked = [row for row in text.split("\n") if row.startswith(MACHINE_PREFIX)]
        if not marked and "\n$ " in text:
            print(f"{path.name}: no line starting {MACHINE_PREFIX!r}", file=sys.stderr)
        if not marked:
            continue
        path.write_text(text.replace(marked[0], line), encoding="utf-8")


def refresh_help_blocks() -> None:
    for path in PAGES:
        lines = path.read_text(encoding="utf-8").split("\n")
        for start, end, args in reversed(help_blocks(lines)):
            lines[start:end] = current_help(args)
        path.write_text("\n".join(lines), encoding="utf-8")


def main(arguments: list[str]) -> int:
    if "--help-blocks" in arguments:
        refresh_help_blocks()
        return 0
    chosen = [p for p in PAGES if not arguments or p.name in arguments]
    chosen.sort(key=lambda p: p.name in TRANSLATIONS)  # an original before its translation
    needed = {DEFAULT_MODEL}.union(*(EXTRA_MODELS.get(p.name, ()) for p in chosen))
    models = {name: own_model(name) for name in sorted(needed)}
    outputs: dict = {"long": {}}
    skipped: list[str] = []
    for path in chosen:
        refresh_page(path, models, outputs, skipped)
    paste_machine_line(chosen)
    print("not run here (their blocks keep earlier output):", *skipped, sep="\n  ")
    print(
        f"waited {sum(WAITS):.0f} s in all for a quiet machine; "
        f"{sum(w >= WAIT_S - 1 for w in WAITS)} examples ran on a busy one"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

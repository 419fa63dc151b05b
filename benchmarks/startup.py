"""How long quill takes to start: `quill --help`, `quill list` with ten models on disk and
`quill inspect`, against `python -c "import typer"` on the same machine (best of N runs each).

Usage: python -m benchmarks.startup [--runs 5] [--model PATH.gguf] [--quill PATH/TO/quill]

A two-command Typer app is timed too: what Typer itself costs to parse and run one command.
The ten models are hard links (or copies, across file systems) of one GGUF, recorded in the
manifest of a scratch QUILL_HOME, as `quill pull` records downloads; nothing is downloaded. Without
--model it uses the SmolLM2 file the tests fetch (QUILL_HOME or the default cache).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 0.1  # each command within this much of the baseline
# What Typer itself costs to run one command (recent releases build pydantic adapters for the
# parameters on every invocation): the floor under any Typer program, quill included.
TYPER_FLOOR = """\
import typer

app = typer.Typer()


@app.command()
def hello(loud: bool = False) -> None:
    print("hello")


@app.command()
def other() -> None:
    pass


app()
"""


def best_of(command: list[str], runs: int, env: dict[str, str]) -> tuple[float, float]:
    """(best wall seconds, best CPU seconds): CPU time (user + system of the child) hardly
    moves when other work shares the cores, so it still compares on a busy machine."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        walls.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return min(walls), min(cpus)


def default_model() -> Path:
    from cli.store.models import list_local
    from cli.store.registry import load_registry

    for model in list_local(load_registry()):
        if model.path.suffix == ".gguf":
            return model.path
    raise SystemExit("no model on disk: pass --model PATH.gguf (or run `quill pull` first)")


def ten_models(home: Path, source: Path) -> None:
    from cli.store.models import file_quant

    quant = file_quant(source)  # recorded as `quill pull` and `quill quantize` record it
    folder = home / "models" / "bench"
    folder.mkdir(parents=True)
    downloads = []
    for index in range(10):
        target = folder / f"copy{index}.gguf"
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
        downloads.append(
            {
                "path": str(target),
                "name": f"bench{index}:q",
                "source": "quantize",
                "repo": None,
                "file": target.name,
                "size": target.stat().st_size,
                "sha256": None,
                "added": time.time(),
                "quant": quant,
            }
        )
    (home / "manifest.json").write_text(json.dumps({"downloads": downloads}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument(
        "--quill", default=str(Path(sys.executable).with_name("quill")), help="another build"
    )
    args = parser.parse_args()
    source = args.model or default_model()
    quill = args.quill
    with tempfile.TemporaryDirectory(prefix="quill-startup-") as scratch:
        home = Path(scratch)
        ten_models(home, source)
        env = dict(os.environ, QUILL_HOME=str(home), HF_HUB_OFFLINE="1")
        # A user's Python caches bytecode (pip compiles it at install; an editable install writes
        # it on the first run); with PYTHONDONTWRITEBYTECODE set, every run would compile quill's
        # sources again while typer's came precompiled, which times the compiler, not quill.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        runs = args.runs
        baseline = best_of([sys.executable, "-c", "import typer"], runs, env)
        floor = home / "typer_floor.py"
        floor.write_text(TYPER_FLOOR)
        rows = [
            ("python -c 'import typer'", baseline),
            (
                "a two-command Typer app",
                best_of([sys.executable, str(floor), "hello"], args.runs, env),
            ),
        ]
        for label, command in (
            ("quill --help", [quill, "--help"]),
            ("quill list (10 models)", [quill, "list"]),
            ("quill inspect", [quill, "inspect", str(home / "models" / "bench" / "copy0.gguf")]),
        ):
            rows.append((label, best_of(command, args.runs, env)))
    print(f"best of {args.runs} runs, {source.name}")
    print(f"{'command':<28} {'wall s':>7} {'over':>7} {'CPU s':>7} {'over':>7}")
    worst_wall = worst_cpu = 0.0
    for label, (wall, cpu) in rows:
        over_wall, over_cpu = wall - baseline[0], cpu - baseline[1]
        worst_wall, worst_cpu = max(worst_wall, over_wall), max(worst_cpu, over_cpu)
        print(f"{label:<28} {wall:7.3f} {over_wall:+7.3f} {cpu:7.3f} {over_cpu:+7.3f}")
    for what, worst in (("wall", worst_wall), ("CPU", worst_cpu)):
        verdict = "within" if worst <= TARGET_S else "NOT within"
        print(f"{what}: each command {verdict} {TARGET_S} s of the baseline (worst {worst:+.3f} s)")


if __name__ == "__main__":
    main()

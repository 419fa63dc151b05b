"""The project's promises about itself: the README's commands, CI, the console script.
(The walls between layers are kept by tests/test_layers.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import QUILL

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start")[1].split("\n## ")[0]
    return re.findall(r"```bash\n(.+?)\n```", quick_start)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_only_the_readmes_commands():
    """CI is green only where a newcomer following the README is: .ci/run runs the README's test
    command verbatim (its venv, the pip it bundles, no upgrade of its own), and every other
    command it runs is printed in the README too."""
    install_and_run, install_and_test = readme_commands()
    assert 'quill run "' in install_and_run
    assert install_and_test.endswith("pytest")
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line for line in lines[1:] if line and not line.startswith("#")]
    setup = ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    assert commands[:3] == [*setup, install_and_test]
    readme = (ROOT / "README.md").read_text()
    for command in commands[3:]:
        assert f"\n{command}\n" in readme, (
            f".ci/run runs {command!r}, which the README does not say"
        )


def test_console_script_help_lists_run_and_the_exit_codes():
    top = subprocess.run([QUILL, "--help"], capture_output=True, text=True, check=True)
    assert "run" in top.stdout
    run = subprocess.run([QUILL, "run", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--model", "--max-tokens", "--stop", "--ctx", "--gpu-layers", "--json", "--raw"):
        assert flag in run.stdout
    assert "130 interrupted" in " ".join(run.stdout.split())

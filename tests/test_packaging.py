"""The project's promises about itself: the README's commands, CI, the console script.
(The walls between layers are kept by tests/test_layers.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick_start = text.split("## Quick start")[1].split("\n## ")[0]
    return re.findall(r"```bash\n(.+?)\n```", quick_start)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    install_and_run, install_and_test = readme_commands()
    assert 'quill run "' in install_and_run
    assert install_and_test.endswith("pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    # CI creates the venv itself, then runs the README's command from `pip install` on.
    assert install_and_test.split(" && ", 2)[2] in ci


def test_console_script_help_lists_run_and_the_exit_codes():
    quill = Path(sys.executable).parent / "quill"
    top = subprocess.run([str(quill), "--help"], capture_output=True, text=True, check=True)
    assert "run" in top.stdout
    run = subprocess.run([str(quill), "run", "--help"], capture_output=True, text=True, check=True)
    for flag in ("--model", "--max-tokens", "--stop", "--ctx", "--gpu-layers", "--json", "--raw"):
        assert flag in run.stdout
    assert "130 interrupted" in " ".join(run.stdout.split())

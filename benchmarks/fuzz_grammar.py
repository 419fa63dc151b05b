"""Fuzz quill's grammar path: generated JSON Schemas and GBNF grammars (sizes, bounds,
repetition, character classes, refs) sent to a running `quill serve` and to `quill run`, each
process under a memory limit; the server must survive every request, keep answering, and stay
under the RSS bound. tests/test_fuzz_grammar.py runs a short round of this in the suite; the
generators and runners are tests/grammar_fuzz.py.

    python -m benchmarks.fuzz_grammar -m MODEL.gguf [--cases 400] [--cli-cases 20] [--seed 1]

Prints the cases tried, the slowest case and the server's peak RSS; exit 1 if the server died,
stopped answering or outgrew the bound (the cases that did it are printed).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from tests.grammar_fuzz import RSS_BOUND, fuzz_cli, fuzz_server, start_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", type=Path, required=True)
    parser.add_argument("--cases", type=int, default=400, help="requests to the server")
    parser.add_argument("--cli-cases", type=int, default=20, help="quill run invocations")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=1800)
    args = parser.parse_args()
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    with tempfile.TemporaryDirectory() as workdir:
        process, url = start_server(args.model, env, Path(workdir))
        try:
            server = fuzz_server(url, process, args.cases, args.seed, args.budget_s)
        finally:
            process.kill()
            process.wait()
    cli = fuzz_cli(args.model, env, args.cli_cases, args.seed, args.budget_s)
    for name, report in (("serve", server), ("run", cli)):
        print(f"{name}: {report.cases} cases, outcomes {dict(sorted(report.statuses.items()))}")
        print(f"  slowest case {report.slowest_s:.2f} s: {report.slowest[:160]}")
        if name == "serve":
            print(f"  server peak RSS {report.peak_rss / 2**20:.0f} MiB (bound {RSS_BOUND >> 20})")
        for failure in report.failures[:10]:
            print(f"  FAILED {failure}")
    return 1 if server.failures or cli.failures else 0


if __name__ == "__main__":
    sys.exit(main())

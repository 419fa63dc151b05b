"""quill bench and quill run --timeline on the tiny model: shapes, formats, pictures, bad axes."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from cli.app import app

GRID = ["-p", "16,32", "-n", "8", "-d", "0,64", "--kv-type", "f16,q8_0", "-t", "1,2", "-r", "1"]


@pytest.fixture(scope="module")
def grid_json(tiny32_path):
    from typer.testing import CliRunner

    result = CliRunner().invoke(app, ["bench", str(tiny32_path), *GRID, "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_one_row_per_combination_with_finite_positive_numbers(grid_json):
    rows = grid_json["rows"]
    combos = {(r["test"], r["depth"], r["kv_type"], r["threads"], r["batch"]) for r in rows}
    assert len(rows) == len(combos) == 2 * 2 * 2 * 3  # kv x threads x depth x (pp16, pp32, tg8)
    assert {r["test"] for r in rows} == {"pp16", "pp32", "tg8"}
    for row in rows:
        assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
        assert len(row["samples"]) == 1
        if row["test"].startswith("pp"):
            assert row["ttft_ms"] > 0 and row["bytes_per_token"] is None
        else:
            assert row["bytes_per_token"] > 0 and row["weights_kv_gb_per_s"] > 0


def test_bytes_per_token_grow_with_depth(grid_json):
    tg = {
        (r["depth"], r["kv_type"], r["threads"]): r for r in grid_json["rows"] if r["test"] == "tg8"
    }
    for (depth, kv, threads), row in tg.items():
        if depth:
            assert row["bytes_per_token"] > tg[(0, kv, threads)]["bytes_per_token"]
    # A q8_0 cache is about half the bytes of an f16 one at the same depth.
    assert tg[(64, "q8_0", 1)]["bytes_per_token"] < tg[(64, "f16", 1)]["bytes_per_token"]


def test_csv_markdown_and_table(runner, tiny32_path):
    small = ["bench", str(tiny32_path), "-p", "16", "-n", "4", "-d", "0,32", "-r", "1"]
    as_csv = runner.invoke(app, [*small, "--csv"])
    assert as_csv.exit_code == 0, as_csv.stderr
    rows = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert len(rows) == 4 and float(rows[0]["tokens_per_s"]) > 0
    as_markdown = runner.invoke(app, [*small, "--markdown"])
    assert as_markdown.stdout.startswith("| test | depth |") and as_markdown.stdout.count("\n") == 6
    table = runner.invoke(app, small)
    assert "tokens/s" in table.stdout and "decode tokens/s by KV depth" in table.stdout
    assert table.stdout.count("█") > 0
    assert "tok/s" in table.stderr  # each row is reported as it is measured


def test_plot_writes_a_png_that_opens(runner, tiny32_path, tmp_path):
    import matplotlib.image

    target = tmp_path / "bench.png"
    args = ["bench", str(tiny32_path), "-p", "16,32", "-n", "4", "-d", "0,32", "-r", "1"]
    result = runner.invoke(app, [*args, "--json", "--plot", str(target)])
    assert result.exit_code == 0, result.stderr
    pixels = matplotlib.image.imread(target)
    assert pixels.shape[0] > 300 and pixels.shape[1] > 600
    assert pixels.std() > 0.05  # not a blank canvas


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-p", "-5"], "-p/--prompt-tokens takes positive numbers"),
        (["-d", "0,-1"], "--depth takes numbers of tokens >= 0"),
        (["-d", "zero"], "--depth takes comma-separated whole numbers"),
        (["--kv-type", "q3_k"], "unknown --kv-type 'q3_k'"),
        (["-d", "9000"], "trained for 4096"),
        (["-r", "0"], "-r/--repetitions must be at least 1"),
        (["--json", "--csv"], "choose one of --json, --csv and --markdown"),
        (["--endpoint", "http://127.0.0.1:9/v1", "--predict"], "--predict predicts this machine"),
    ],
)
def test_bad_axes_are_refused_clearly(runner, tiny32_path, args, needle):
    result = runner.invoke(app, ["bench", str(tiny32_path), "-n", "4", *args])
    assert result.exit_code == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_quantized_kv_on_heads_it_cannot_split_is_refused(runner, tiny_path):
    result = runner.invoke(
        app, ["bench", str(tiny_path), "-p", "16", "-n", "4", "--kv-type", "q8_0"]
    )
    assert result.exit_code == 2
    assert "blocks of 32 values, but this model's heads have 16" in result.stderr


def test_run_timeline_lists_every_token_and_the_gaps(runner, tiny_path):
    result = runner.invoke(
        app, ["run", "-m", str(tiny_path), "--raw", "-n", "6", "--timeline", "hi"]
    )
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    start = lines.index("token  arrived (ms)  gap (ms)  text")
    arrivals = [float(line.split()[1]) for line in lines[start + 1 : start + 7]]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    assert "gaps between tokens (ms)" in result.stderr


def test_repack_on_and_off_are_compared_and_named(runner, tiny32_path):
    """`--repack on,off` loads the model both ways and names each row's CPU path."""
    small = ["bench", str(tiny32_path), "-p", "16", "-n", "4", "-r", "1", "--repack", "on,off"]
    as_json = runner.invoke(app, [*small, "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    rows = json.loads(as_json.stdout)["rows"]
    assert len(rows) == 4
    paths = [row["cpu_path"] for row in rows]
    assert paths[2:] == ["plain", "plain"] and paths[0] == paths[1] != "plain"
    assert as_json.stderr.count("CPU path: ") == 2 and "CPU path: repack off" in as_json.stderr
    as_markdown = runner.invoke(app, [*small, "--markdown"])
    assert as_markdown.stdout.splitlines()[0].endswith("| CPU path |")
    refused = runner.invoke(app, ["bench", str(tiny32_path), "--repack", "maybe"])
    assert refused.exit_code == 2 and "--repack takes auto, on, off or a list" in refused.stderr


def test_help_states_the_batch_and_threads_bench_uses(runner, tiny_path):
    """The defaults --help states are the ones a run takes: -p 64 -n 16 runs batch 65."""
    from cli.engine.hardware import physical_cores

    shown = " ".join(runner.invoke(app, ["bench", "--help"]).stdout.split())
    assert "so -p 64 -n 16 runs batch 65" in shown
    assert "Default: the physical cores that other work leaves free" in shown
    result = runner.invoke(
        app, ["bench", str(tiny_path), "-p", "64", "-n", "16", "-r", "1", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [row["batch"] for row in rows] == [65, 65]
    assert all(1 <= row["threads"] <= physical_cores() for row in rows)
    deep = runner.invoke(
        app, ["bench", str(tiny_path), "-p", "600", "-n", "4", "-r", "1", "--json"]
    )
    assert [row["batch"] for row in json.loads(deep.stdout)["rows"]] == [512, 512]


@pytest.fixture(scope="module")
def tiny_server(tiny_path, quill_home, tmp_path_factory):
    from conftest import KEY, start_server

    process, url = start_server(
        quill_home, tmp_path_factory.mktemp("serve-bench"), str(tiny_path), "--api-key", KEY
    )
    yield f"{url}/v1", KEY
    process.terminate()
    process.wait(timeout=30)


def test_endpoint_bench_prefills_every_repetition_without_the_prompt_cache(runner, tiny_server):
    """Against quill serve, whose prefix cache would answer a repeated prompt: every measured
    repetition is prefilled in full (the server reports no cached token), the output says so, and
    the server's threads and batch are shown as unknown, not as 0."""
    from cli.api.client import stream_chat
    from cli.measure.bench import GREEDY_NO_EOS, endpoint_prompt

    url, key = tiny_server
    args = ["bench", "--endpoint", url, "--api-key", key, "-p", "48", "-n", "4", "-r", "3"]
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    assert "prompt cache off: a distinct prompt per repetition" in as_json.stderr
    assert "reused" not in as_json.stderr
    pp, tg = json.loads(as_json.stdout)["rows"]
    assert pp["cached_tokens"] == 0 and len(pp["samples"]) == 3 and pp["tokens_per_s"] > 0
    assert (pp["threads"], pp["batch"], tg["threads"], tg["batch"]) == (None,) * 4
    # The control: the same prompt sent twice with the cache on is answered from it.
    for _ in range(2):
        last = list(stream_chat(url, [("user", endpoint_prompt(48, 1))], None, 1, GREEDY_NO_EOS,
                                api_key=key))[-1]  # fmt: skip
    assert last.cached_prompt_tokens > 40
    table = runner.invoke(app, args)
    pp_line = next(line for line in table.stdout.splitlines() if line.startswith("pp48"))
    assert pp_line.split()[3:5] == ["-", "-"]

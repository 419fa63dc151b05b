"""quill config and the defaults it shows (cli/store/config.py): a default model, endpoint and
stats choice from an environment variable, else QUILL_HOME/config.toml, else quill's own; a
flag beats them all. Real runs of the real model."""

from __future__ import annotations

import json

import pytest

from conftest import quill_env, run_quill


def shown(home, **env: str) -> dict[str, dict]:
    result = run_quill(home, "config", "--json", env=quill_env(home, **env))
    assert result.returncode == 0, result.stderr
    return {s["name"]: s for s in json.loads(result.stdout)["settings"]}


def test_config_shows_each_setting_and_where_it_comes_from(tmp_path):
    assert {n: (s["value"], s["source"]) for n, s in shown(tmp_path).items()} == {
        "model": (None, "default"), "endpoint": (None, "default"), "stats": (None, "default"),
    }  # fmt: skip
    for args in (["model", "qwen2.5:0.5b"], ["stats", "off"]):
        result = run_quill(tmp_path, "config", "set", *args)
        assert result.returncode == 0, result.stderr
    file = tmp_path / "config.toml"
    assert file.read_text() == 'model = "qwen2.5:0.5b"\nstats = false\n'
    settings = shown(tmp_path)
    assert settings["model"] == {"name": "model", "value": "qwen2.5:0.5b", "source": str(file)}
    assert settings["stats"]["value"] is False
    # The variable beats the file; set but empty, it is unset.
    assert shown(tmp_path, QUILL_MODEL="smollm2-135m")["model"]["source"] == "QUILL_MODEL"
    assert shown(tmp_path, QUILL_MODEL="")["model"]["source"] == str(file)
    table = run_quill(tmp_path, "config")
    assert table.stdout.splitlines()[0].split() == ["SETTING", "VALUE", "FROM"]
    rows = {line.split()[0]: line.split(maxsplit=1)[1] for line in table.stdout.splitlines()[1:]}
    assert rows["model"].split() == ['"qwen2.5:0.5b"', str(file)]
    assert rows["endpoint"].split() == ["none", "(models", "run", "here)", "quill"]
    assert run_quill(tmp_path, "config", "unset", "model").returncode == 0
    assert file.read_text() == "stats = false\n"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["config", "set", "colour", "red"], {}, "no setting 'colour'"),
        (["config", "set", "stats", "maybe"], {}, "must be true or false"),
        (["config", "frobnicate"], {}, "takes show, set KEY VALUE or unset KEY"),
        (["config"], {"QUILL_STATS": "perhaps"}, "QUILL_STATS must be true or false"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(tmp_path, args, env, needle):
    result = run_quill(tmp_path, *args, env=quill_env(tmp_path, **env))
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_config_file_edited_wrongly_is_one_line(tmp_path):
    (tmp_path / "config.toml").write_text('model = "unterminated\n')
    result = run_quill(tmp_path, "config")
    assert result.returncode == 2 and "is not valid TOML" in result.stderr
    (tmp_path / "config.toml").write_text("colour = 'red'\n")
    result = run_quill(tmp_path, "run", "hi")
    assert result.returncode == 2 and "sets colour, which quill does not know" in result.stderr


def test_the_default_model_is_the_users(tmp_path, smollm2_path):
    result = run_quill(tmp_path, "config", "set", "model", str(smollm2_path))
    assert result.returncode == 0, result.stderr
    ran = run_quill(tmp_path, "run", "-n", "2", "--json", "hello")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["path"] == str(smollm2_path)


def test_the_default_endpoint_is_where_run_sends_its_request(tmp_path):
    """A server that is not there: the error names the configured address, so run tried it."""
    url = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    result = run_quill(
        tmp_path, "run", "-n", "2", "hello", env=quill_env(tmp_path, QUILL_ENDPOINT=url)
    )
    assert result.returncode == 6, result.stderr
    assert "127.0.0.1:9" in result.stderr


def test_the_stats_choice_hides_the_stats_line_and_a_flag_still_does(tmp_path, smollm2_path):
    args = ("run", "-m", str(smollm2_path), "-n", "2", "hello")
    shown = run_quill(tmp_path, *args)
    assert shown.returncode == 0 and "TTFT" in shown.stderr
    hidden = run_quill(tmp_path, *args, env=quill_env(tmp_path, QUILL_STATS="0"))
    assert hidden.returncode == 0 and "TTFT" not in hidden.stderr
    assert run_quill(tmp_path, "config", "set", "stats", "no").returncode == 0
    assert "TTFT" not in run_quill(tmp_path, *args).stderr
    # The variable beats the file.
    assert "TTFT" in run_quill(tmp_path, *args, env=quill_env(tmp_path, QUILL_STATS="on")).stderr
    assert (
        "TTFT"
        not in run_quill(
            tmp_path, *args, "--no-stats", env=quill_env(tmp_path, QUILL_STATS="on")
        ).stderr
    )

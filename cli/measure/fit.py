"""Whether a model fits this machine, decided from its header before any weight byte is fetched:
the memory plan at the context it will run with (the one `quill run` makes at load), against the
memory there is (RAM, each GPU's free memory, or a budget the user gives), and, for a repository
with several GGUF files, which of them to take.

The choice: the largest file whose plan takes at most HEADROOM of the memory (the rest is left to
the system, the page cache and whatever else runs); where none is that small but some fit, the
largest that fits. A file "fits" when its plan is at most the memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cli.engine.options import LoadOptions, memory_plan
from cli.store.header import ModelHeader
from quant.gguf import file_type_name
from quant.memory import MemoryPlan

HEADROOM = 0.9  # of the memory, at most, that a chosen file's plan may take


@dataclass(frozen=True)
class Room:
    """The memory a model must fit in: the largest of RAM's and each GPU's, or a budget."""

    where: str  # "RAM", a GPU's name, or "--mem"
    bytes: int

    @classmethod
    def largest(cls, available: list[tuple[str, int]]) -> Room:
        where, free = max(available, key=lambda memory_free: memory_free[1])
        return cls(where, free)


@dataclass(frozen=True)
class ModelFile:
    """One GGUF file of a model: its plan, and what it is predicted to do here."""

    file: str
    quant: str | None  # general.file_type's name, e.g. Q4_K_M
    size_bytes: int
    memory: MemoryPlan
    fits: bool
    decode_tokens_per_s: float | None  # predicted here; None where no prediction was made

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "quant": self.quant,
            "size_bytes": self.size_bytes,
            "memory": self.memory.as_dict(),
            "fits": self.fits,
            "predicted_decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass(frozen=True)
class FitDecision:
    """The files considered (one, where a file was named), the memory, and the one taken."""

    model: str
    files: tuple[ModelFile, ...]
    room: Room
    chosen: ModelFile
    why: str

    @property
    def fits(self) -> bool:
        return self.chosen.fits

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "memory_available": {"where": self.room.where, "bytes": self.room.bytes},
            "headroom": HEADROOM,
            "files": [one.as_dict() for one in self.files],
            "chosen": self.chosen.file,
            "fits": self.fits,
            "why": self.why,
        }


def model_file(
    name: str,
    model: ModelHeader,
    options: LoadOptions,
    room: Room,
    predict: Callable[[ModelHeader], float | None],
) -> ModelFile:
    """A file's plan at options' context (the plan quill run makes at load) and prediction."""
    memory = memory_plan(model.shape, options)
    quant = file_type_name(model.header)
    fits = memory.total_bytes <= room.bytes
    return ModelFile(name, quant, model.size, memory, fits, predict(model))


def decide(model: str, files: list[ModelFile], room: Room) -> FitDecision:
    """The file to take of those given (one or more), and why, in a sentence."""
    by_size = sorted(files, key=lambda one: one.size_bytes)
    if len(by_size) == 1:
        only = by_size[0]
        verdict = "fits" if only.fits else "does not fit"
        return FitDecision(model, tuple(files), room, only, f"{verdict} in {room.where}")
    roomy = [one for one in by_size if one.memory.total_bytes <= HEADROOM * room.bytes]
    fitting = [one for one in by_size if one.fits]
    share = f"{HEADROOM:.0%} of {room.where}"
    if roomy:
        why = f"the largest of {len(files)} files whose plan takes at most {share}"
        return FitDecision(model, tuple(files), room, roomy[-1], why)
    if fitting:
        why = f"none takes at most {share}; the largest that fits at all, with little to spare"
        return FitDecision(model, tuple(files), room, fitting[-1], why)
    why = f"none of the {len(files)} files fits in {room.where}; the smallest needs the least"
    return FitDecision(model, tuple(files), room, by_size[0], why)

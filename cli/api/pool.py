"""The models a server holds, by name: loaded on demand (once, however many requests ask at
once; other models keep serving meanwhile), kept for a keep-alive after their last request
(Ollama's), evicted least recently used first when --max-models or the memory limit calls for
room (never one with requests in flight), and refused before loading when one cannot fit alone.
Each loaded model has its own engine and batch scheduler (so its own prefix cache)."""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol

from cli.api.server import ApiError
from cli.engine.batching import BatchScheduler
from cli.engine.embedqueue import EmbeddingScheduler
from cli.engine.shelf import SHELF
from cli.errors import ModelLoadError
from cli.units import human_bytes

FOREVER = math.inf
WAIT_FOR_ROOM_S = 600  # a load waits this long for busy models to finish before a 503
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def parse_duration(value: Any) -> float:
    """Seconds from Ollama's keep_alive forms: a number of seconds, or '5m', '1h30m', '90s';
    negative: forever. ValueError for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return FOREVER if value < 0 else float(value)
    text = value.strip().lower() if isinstance(value, str) else None
    if text:
        sign, digits = (-1, text[1:]) if text.startswith("-") else (1, text)
        if re.fullmatch(r"\d+(\.\d+)?", digits):
            return FOREVER if sign < 0 else float(digits)
        if re.fullmatch(f"(?:{_DURATION.pattern})+", digits):
            seconds = sum(float(n) * _UNIT_S[unit] for n, unit in _DURATION.findall(digits))
            return FOREVER if sign < 0 else seconds
    raise ValueError(f"not a duration: {value!r}; write seconds or one like 5m, 30s, 1h (-1: ever)")


# What runs a loaded model's requests: a generation model's batches, or an embedding model's.
Scheduler = BatchScheduler | EmbeddingScheduler


@dataclass(frozen=True)
class PoolAdvice:
    """What a refused client is told to do, past the facts: the command that starts the server
    words it with its own options (the pool knows none)."""

    models_busy: str = "retry later"
    model_too_large: str = "use a smaller quant"


@dataclass
class PooledModel:
    label: str
    memory_bytes: int  # the memory plan's total, weights to buffers
    scheduler: Scheduler | None = None  # None while loading
    loaded: threading.Event = field(default_factory=threading.Event)
    failure: ApiError | None = None  # why the load failed
    in_flight: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float = FOREVER  # monotonic; FOREVER: until evicted or stopped
    unload_when_idle: bool = False  # stopped while requests were in flight

    def status(self, now: float) -> dict[str, Any]:
        scheduler = self.scheduler
        left = None if self.expires_at == FOREVER or self.in_flight else self.expires_at - now
        return {
            "name": self.label,
            "status": "loaded" if scheduler is not None else "loading",
            "size": self.memory_bytes,
            "requests": self.in_flight,
            "slots": scheduler.engine.parallel if scheduler else 0,
            "slots_busy": scheduler.busy_slots if scheduler else 0,
            "requests_waiting": scheduler.queued if scheduler else 0,
            "expires_in_s": None if left is None else round(max(0.0, left), 1),
            "expires_at": None if left is None else round(time.time() + max(0.0, left), 1),
        }


class Catalog(Protocol):
    """What a pool may load (label -> file; asked again when a name is not found), how one opens,
    and its memory plan's total with the parts in words (serve.py's ServeCatalog)."""

    def models(self) -> dict[str, Path]: ...
    def open(self, label: str, path: Path) -> Scheduler: ...
    def memory_bytes(self, path: Path) -> tuple[int, str]: ...


class ModelPool:
    def __init__(
        self,
        catalog: Catalog | None = None,
        keep_alive_s: float = 300.0,
        max_models: int = 0,  # 0: no cap but memory
        memory_limit: int = 0,  # 0: none
        on_event: Callable[[str], None] | None = None,
        advice: PoolAdvice = PoolAdvice(),
    ) -> None:
        self.catalog = catalog
        self.advice = advice
        self.keep_alive_s = keep_alive_s
        self.max_models = max_models
        self.memory_limit = memory_limit
        self.on_event = on_event or (lambda line: None)
        self.default: str | None = None  # the model a request naming none gets
        self.aliases: dict[str, str] = {}  # more names of a model: name -> its label
        # False: a one-model server answers whatever model a request names (llama-server's
        # rule; clients send placeholders); with several models an unknown name is a 404.
        self.strict = False
        self._files: dict[str, Path] = {}
        self._models: dict[str, PooledModel] = {}
        self._plans: dict[tuple[Path, int, int], tuple[int, str] | ApiError] = {}
        # For /metrics: loads by model, unloads by model and why (Counters are thread-safe enough
        # for a scrape: each += is one bytecode step under the GIL, and a scrape only reads).
        self.loads: Counter[str] = Counter()
        self.unloads: Counter[tuple[str, str]] = Counter()
        # Decode steps (and the sequences in them) of the schedulers unloaded: /metrics' totals
        # must not fall when a model leaves.
        self.retired_steps = [0, 0]
        self._lock = threading.Condition()
        self._closed = False
        self._draining = False
        self._reaper = threading.Thread(target=self._reap, name="quill-keep-alive", daemon=True)
        self._reaper.start()

    def add_loaded(self, label: str, scheduler: Scheduler, memory_bytes: int = 0) -> None:
        """A model loaded before serving: kept until stopped or evicted (no keep-alive)."""
        with self._lock:
            model = PooledModel(label, memory_bytes, scheduler)
            model.loaded.set()
            self._models[label] = model
            self.default = self.default or label

    # --- names ----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every servable model: the catalog's (those named first; a file removed since, by
        `quill rm` or by hand, is gone from the list), then any other loaded. Reads the disk:
        never called under the lock."""
        if self.catalog is not None:
            self._files = {
                label: path for label, path in self.catalog.models().items() if path.is_file()
            }
        with self._lock:
            return list(dict.fromkeys([*self._files, *self._models]))

    def _label(self, name: str | None) -> str:
        label = self._known_label(name)
        if label is None:
            self.names()
            label = self._known_label(name)
        if label is not None:
            return label
        labels = list(dict.fromkeys([*self._files, *self._models]))
        listed = ", ".join(f"'{label}'" for label in labels[:8]) or "none"
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"The model '{name}' does not exist; this server has {listed}",
            "model_not_found",
            "model",
        )

    def _known_label(self, name: str | None) -> str | None:
        """The label name means among the names known now (no disk read), or None."""
        if name is None or name == "quill":
            if self.default is None:
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    "this server serves several models: name one in 'model' (GET /v1/models "
                    "lists them)",
                    "model_not_found",
                    "model",
                )
            return self.default
        # The catalog's order first: a name without its tag is the first file with that name
        # (models.yaml's default tag leads), whichever of them is loaded.
        labels = list(dict.fromkeys([*self._files, *self._models]))
        name = self.aliases.get(name, name)
        if name in labels:
            return name
        for label in labels:
            if name == label.partition(":")[0] or (
                label.endswith(".gguf") and name == Path(label).stem
            ):
                return label
        known = self.catalog is None or self._files  # else the catalog is not read yet
        if not self.strict and known and len(labels) == 1 and self.default in labels:
            return self.default
        return None

    # --- a request's use of a model -------------------------------------------------------------

    def try_acquire_loaded(self, name: str | None) -> PooledModel | None:
        """The model name means, counted in flight, if it is loaded and serving now; else None
        (then acquire()). Never waits and never reads the disk: the server calls it on its
        event loop, so a request to a loaded model never queues behind loads."""
        with self._lock:
            label = self._known_label(name)
            model = self._models.get(label) if label is not None else None
            scheduler = model.scheduler if model is not None else None
            if model is None or scheduler is None or not scheduler.alive:
                return None
            model.in_flight += 1
            return model

    def acquire(self, name: str | None) -> PooledModel:
        """The model a request names, loaded (by this call or the one already loading it), with
        the request counted in flight until release(). Blocks: the catalog read, the memory plan
        and the load run here, in the caller's thread, never under the pool's lock (which
        /health, /api/ps and every request take)."""
        label = self._label(name)
        self._replace_if_dead(label)
        deadline = time.monotonic() + WAIT_FOR_ROOM_S
        evicted = None
        needs: int | None = None
        with self._lock:
            loaded_or_loading = label in self._models
        if not loaded_or_loading:
            needs = self._plan(label)
        with self._lock:
            while True:
                model = self._models.get(label)
                if model is not None:
                    model.in_flight += 1
                    break
                if needs is None:  # it was loaded a moment ago, and is gone again
                    break
                evicted = self._make_room(needs)
                if evicted is not None:
                    model = PooledModel(label, needs, in_flight=1)
                    self._models[label] = model
                    break
                if self._draining:
                    message = "the server is shutting down; retry against another instance"
                    raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, message, "server_shutting_down")
                if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise ApiError(
                        HTTPStatus.SERVICE_UNAVAILABLE,
                        f"no room to load {label}: every loaded model has requests in flight; "
                        + self.advice.models_busy,
                        "models_busy",
                    )
        if model is None:
            return self.acquire(name)
        if model.scheduler is None and evicted is not None:  # this call loads it
            self._unload(evicted, "evicted", "to make room")
            self._load(model)
        model.loaded.wait()
        if model.failure is not None:
            self.release(model, 0)
            raise model.failure
        return model

    def _plan(self, label: str) -> int:
        """The memory plan's total for label's file, refused here when it cannot fit alone or
        the file cannot be read as a model (400 model_load_failed, named by label: the path on
        the server's disk is none of the client's business). Cached per file and its size and
        time, refusals too, so a burst of requests for one file reads its header once."""
        assert self.catalog is not None  # a label without a file is always loaded
        path = self._files[label]
        try:
            stat = path.stat()
        except OSError as error:
            raise self._unreadable(label, path, error) from None
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key not in self._plans:
            try:
                self._plans[key] = self.catalog.memory_bytes(path)
            except (OSError, ModelLoadError) as error:  # a header past llama.cpp's limits
                self._plans[key] = self._unreadable(label, path, error)
        planned = self._plans[key]
        if isinstance(planned, ApiError):
            raise planned
        needs, parts = planned
        if self.memory_limit and needs > self.memory_limit:
            message = (
                f"{label} needs {human_bytes(needs)} ({parts}), more than this server's memory "
                f"limit of {human_bytes(self.memory_limit)}: {self.advice.model_too_large}"
            )
            self.on_event(f"refused {message}")
            raise ApiError(HTTPStatus.BAD_REQUEST, message, "model_too_large", "model")
        return needs

    @staticmethod
    def _unreadable(label: str, path: Path, error: Exception) -> ApiError:
        reason = str(error).replace(str(path), label) or type(error).__name__
        message = f"{label} failed to load: {reason}"
        return ApiError(HTTPStatus.BAD_REQUEST, message, "model_load_failed")

    def reloadable(self, label: str) -> bool:
        """Whether the pool can load label again: its catalog has it (a model loaded before
        serving is there too, though no name has been looked up yet)."""
        if self.catalog is None:
            return False
        if label not in self._files:
            self.names()
        return label in self._files

    def _replace_if_dead(self, label: str) -> None:
        """Unload label's model when its scheduler has stopped on an error, once no request is
        in flight on it (those got their 503), so that this request loads it again, as Ollama
        starts a crashed runner again. A model the pool cannot load again (a pool without a
        catalog, as an embedding program may set up) stays and refuses."""
        reloadable = self.reloadable(label)  # may read the catalog: not under the lock
        with self._lock:
            model = self._models.get(label)
            scheduler = model.scheduler if model is not None else None
            if (
                model is None
                or scheduler is None
                or scheduler.alive
                or scheduler.failure is None
                or model.in_flight
                or not reloadable
                or self._closed
                or self._draining
            ):
                return
            del self._models[label]
            self._lock.notify_all()
        self._unload([model], "replaced", f"{scheduler.stopped_reason}; loading it again")

    def release(self, model: PooledModel, keep_alive_s: float | None = None) -> None:
        """A request is done with model: it stays keep_alive_s (None: the server's) from now; the
        keep-alive thread unloads it, so that no request waits for an unload."""
        with self._lock:
            model.in_flight -= 1
            model.last_used = time.monotonic()
            if keep_alive_s is not None or model.expires_at != FOREVER:  # else: pinned
                keep = self.keep_alive_s if keep_alive_s is None else keep_alive_s
                model.expires_at = model.last_used + keep
            if model.unload_when_idle:
                model.expires_at = model.last_used
            self._lock.notify_all()

    def stop(self, name: str) -> str:
        """Unload a model now, or once its requests in flight finish: what happened, in words."""
        label = self._label(name)
        with self._lock:
            model = self._models.get(label)
            if model is None or model.scheduler is None:
                return f"{label} is not loaded"
            if model.in_flight:
                model.unload_when_idle = True
                return f"{label} unloads when its {model.in_flight} requests in flight finish"
            self._models.pop(label)
            self._lock.notify_all()
        self._unload([model], "stopped", "stopped")
        return f"{label} unloaded"

    def loaded(self) -> list[PooledModel]:
        with self._lock:
            return list(self._models.values())

    def status(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [model.status(now) for model in self.loaded()]

    def drain(self) -> None:
        """No more loads: a request waiting for room is refused (a load under way finishes)."""
        with self._lock:
            self._draining = True
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            models, self._models = list(self._models.values()), {}
            self._lock.notify_all()
        for model in models:
            model.loaded.wait()
        self._unload(models, "shutdown")
        SHELF.clear()

    # --- loading and unloading ------------------------------------------------------------------

    def _make_room(self, needs: int) -> list[PooledModel] | None:
        """The idle models to unload for a new model of needs bytes, taken out of the pool;
        None while models with requests in flight hold the room. Called under the lock: counts
        and sums only (the plan was made before, by _plan)."""
        idle = sorted(
            (m for m in self._models.values() if m.in_flight == 0 and m.scheduler is not None),
            key=lambda m: m.last_used,
        )
        kept, evicted = list(self._models.values()), []

        def crowded() -> bool:
            over_count = self.max_models and len(kept) >= self.max_models
            used = sum(m.memory_bytes for m in kept)
            return bool(over_count or (self.memory_limit and used + needs > self.memory_limit))

        while crowded() and idle:
            victim = idle.pop(0)
            kept.remove(victim)
            evicted.append(victim)
        if crowded():
            return None
        for victim in evicted:
            del self._models[victim.label]
        return evicted

    def _load(self, model: PooledModel) -> None:
        assert self.catalog is not None
        started = time.monotonic()
        try:
            model.scheduler = self.catalog.open(model.label, self._files[model.label])
        except Exception as error:  # a file that is not a model, a template that fails
            model.failure = self._unreadable(model.label, self._files[model.label], error)
            with self._lock:
                self._models.pop(model.label, None)
                self._lock.notify_all()
        else:
            self.loads[model.label] += 1
            mapped = " from its mapped weights" if model.scheduler.engine.from_shelf else ""
            self.on_event(
                f"loaded {model.label}{mapped} in {time.monotonic() - started:.1f} s "
                f"({human_bytes(model.memory_bytes)} planned)"
            )
            with self._lock:
                model.expires_at = time.monotonic() + self.keep_alive_s
                if self._closed:
                    self._models.pop(model.label, None)
        finally:
            model.loaded.set()
        if self._closed and model.scheduler is not None:
            self._unload([model], "shutdown")

    def _unload(self, models: list[PooledModel], reason: str, why: str | None = None) -> None:
        """Unload models; reason: a word for /metrics (evicted, keep_alive, stopped, replaced,
        shutdown); why: the words of the log line (none: no line)."""
        for model in models:
            if model.scheduler is None:
                continue
            scheduler, model.scheduler = model.scheduler, None
            self.unloads[model.label, reason] += 1
            if isinstance(scheduler, BatchScheduler):
                self.retired_steps[0] += scheduler.steps
                self.retired_steps[1] += scheduler.sequences_stepped
            scheduler.close()
            kept = scheduler.persist()  # before it forgets: the KV store keeps its sequences
            # Evicted to make room, it may be asked for again soon: its mapped weights stay
            # (engine/shelf.py). Keep-alive, quill stop and shutdown free everything.
            scheduler.engine.close(shelve=reason == "evicted")
            if kept:
                states = "1 KV state" if kept == 1 else f"{kept} KV states"
                self.on_event(f"kept {states} of {model.label} in the KV store")
            if why is not None:
                self.on_event(f"unloaded {model.label} ({why})")

    def _reap(self) -> None:
        """Unload the idle models whose keep-alive has passed."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                idle = [m for m in self._models.values() if m.in_flight == 0 and m.scheduler]
                expired = [m for m in idle if m.expires_at <= now]
                for model in expired:
                    del self._models[model.label]
                if expired:
                    self._lock.notify_all()
                    self._lock.release()
                    try:
                        self._unload(expired, "keep_alive", "keep-alive passed")
                    finally:
                        self._lock.acquire()
                    continue
                soonest = min((m.expires_at for m in idle), default=FOREVER)
                self._lock.wait(timeout=min(1.0, max(0.01, soonest - now)))

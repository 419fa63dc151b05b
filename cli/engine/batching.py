"""Continuous batching (docs/serve.md): one thread admits waiting requests into free slots (each
its own sequence, sampler chain and text stream), decodes one batch of every decoding slot's next
token plus as much of the waiting prompts as fits, and samples every slot that got logits.

A slot keeps its cells after its request (llama-server's cache_prompt): a new request takes the
idle slot sharing the longest prefix with its prompt (else the least recently used); with a RAM
budget (park_bytes) a cache about to be overwritten is parked, and loaded back for a later
request that shares more with it than with any slot.

With a KV store on disk (cli/store/promptcache.py, shared with quill run and chat), a request
whose prompt a stored state covers further than any slot or parked cache loads that state; a
request that prefilled a long prompt (the store's keep_after_prefill) is kept at once, for other
processes; and persist(), once the scheduler is closed, keeps every slot's and parked sequence of
the store's min_tokens or more, so that what a model held survives its unloading.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from cli.engine.engine import Engine
from cli.engine.events import PromptProgress, StreamEvent
from cli.engine.kvcache import DecodeError
from cli.engine.sampling import SamplingParams
from cli.engine.settings import PromptCache
from cli.engine.tokenstep import SequenceStep
from cli.errors import QueueFullError
from cli.sequence import common_prefix

# A request that would drop fewer of a slot's cached tokens than this (a conversation's next turn
# re-rendering the end of the last reply) is not worth parking the slot's cache for.
PARK_MIN_TOKENS = 64
# A scheduler idle this long ends its thread (the next submit starts another). OpenMP gives each
# thread that computes a team of worker threads; while a process's teams together outnumber the
# cores, every barrier sleeps instead of spinning, and a server with several models loaded would
# decode slower on whichever is busy, for as long as the others stay loaded.
IDLE_EXIT_S = 5.0


class SchedulerStoppedError(Exception):
    """The scheduler's thread has stopped (shut down, or died of an error): it takes no requests."""


class SlotBusyError(Exception):
    """A slot action named a slot that is serving a request."""


class SlotStateNotFoundError(Exception):
    """A slot restore named a state the KV store does not hold (never saved, another model's,
    evicted, or refused by llama.cpp)."""


# How long a slot action waits for the scheduler's thread to take it (it runs between steps).
SLOT_ACTION_TIMEOUT_S = 120.0


@dataclass
class BatchRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    # PromptProgress only where progress is asked for; stream() passes over them
    events: queue.Queue[StreamEvent | PromptProgress | BaseException] = field(
        default_factory=queue.Queue
    )
    cancelled: threading.Event = field(default_factory=threading.Event)
    cache_prompt: bool = True  # False: prefill the whole prompt, reusing no slot's cache
    cached_tokens: int = 0  # prompt tokens found in the slot's cache, set when admitted
    restored_tokens: int = 0  # of cached_tokens, those loaded from the KV store on disk
    logprobs: int | None = None  # alternatives per token's logprobs; None: no logprobs
    progress: bool = False  # also put a PromptProgress when admitted and after each prompt batch
    post_sampling: bool = False  # logprobs of what the sampler chain drew from (SequenceStep)

    def stream(self) -> Iterator[StreamEvent]:
        """The events of this request, as they are made; the last has finish_reason set."""
        while True:
            item = self.events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, PromptProgress):
                continue
            yield item
            if item.finish_reason is not None:
                return


@dataclass
class _Slot:
    request: BatchRequest
    step: SequenceStep
    pending: deque[int]  # prompt tokens not yet decoded
    output: int = -1  # where this slot's logits are in the last batch, or -1
    last_token: int = -1


class BatchScheduler:
    """Drives the engine from a thread of its own (slot i: sequence i); submit() from any."""

    def __init__(
        self,
        engine: Engine,
        max_queued: int = 16,
        park_bytes: int = 0,
        idle_exit_s: float = IDLE_EXIT_S,
        on_note: Callable[[str], None] = lambda line: None,
    ) -> None:
        """on_note: one line for the server's log (a KV store entry refused or not written);
        the KV store on disk is the engine's prompt_cache (None: none)."""
        if engine.parallel > engine.n_batch:
            # Every decoding sequence puts one token with logits into each batch.
            raise ValueError(
                f"{engine.parallel} sequences cannot share a batch of {engine.n_batch} tokens"
            )
        self.engine = engine
        self.max_queued = max_queued
        self.failure: BaseException | None = None  # what killed the loop, if anything did
        self._waiting: deque[BatchRequest] = deque()
        self._slots: list[_Slot | None] = [None] * engine.parallel
        # When each slot last took a request: misses and ties go to the least recently used,
        # so the caches of the conversations seen last survive longest.
        self._last_used: list[int] = [0] * engine.parallel
        self._admitted = 0
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to a slot's cache, in all
        # Caches moved out of slots, least recently parked first: (tokens, state).
        self.park_bytes = park_bytes
        self._parked: list[tuple[list[int], bytearray]] = []
        self.parked_bytes = 0
        self.store: PromptCache | None = engine.prompt_cache
        self.on_note = on_note
        self._wake = threading.Condition()
        # Work that needs the context (slot save, restore, erase), run by the loop between steps.
        self._tasks: deque[tuple[Callable[[], Any], Future]] = deque()
        self._stopping = False
        self.steps = 0
        self.sequences_stepped = 0  # the busy slots of every step, summed
        self.max_sequences_in_a_step = 0
        self.idle_exit_s = idle_exit_s
        self._thread: threading.Thread | None = None  # None: ended idle, none needed yet
        with self._wake:
            self._start()

    def _start(self) -> None:  # under the lock
        self._thread = threading.Thread(target=self._loop, name="quill-batch", daemon=True)
        self._thread.start()

    def submit(self, request: BatchRequest) -> BatchRequest:
        with self._wake:
            if not self.alive:
                raise SchedulerStoppedError(self.stopped_reason)
            if len(self._waiting) >= self.max_queued:
                raise QueueFullError(len(self._waiting))
            self._waiting.append(request)
            if self._thread is None:
                self._start()
            self._wake.notify()
        return request

    @property
    def busy_slots(self) -> int:
        return sum(slot is not None for slot in self._slots)

    def slots_processing(self) -> list[bool]:
        """Which slots hold a request now, slot by slot (a snapshot, read without the lock)."""
        return [slot is not None for slot in self._slots]

    @property
    def queued(self) -> int:
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        thread = self._thread
        return not self._stopping and (thread is None or thread.is_alive())

    @property
    def stopped_reason(self) -> str:
        if self.failure is not None:
            return f"the batch scheduler stopped on an error: {self.failure!r}"
        return "the server is shutting down"

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _loop(self) -> None:
        ended_idle = False
        try:
            while True:
                with self._wake:
                    while not (self._stopping or self._waiting or self.busy_slots or self._tasks):
                        # Rechecked under the lock: a submit that came as the wait timed out saw
                        # this thread and started none.
                        if not self._wake.wait(self.idle_exit_s) and not (
                            self._waiting or self._tasks
                        ):
                            self._thread, ended_idle = None, True
                            return
                    if self._stopping:
                        return
                    tasks, self._tasks = self._tasks, deque()
                for work, done in tasks:  # outside the lock: a save writes a file
                    try:
                        done.set_result(work())
                    except Exception as error:  # the action's failure, not the server's
                        done.set_exception(error)
                with self._wake:
                    self._admit()
                self._drop_cancelled()
                if self.busy_slots:
                    self._step()
        except BaseException as error:  # each request's own errors are caught below this
            self.failure = error  # /health reports it and submit() refuses from now on
        finally:
            if not ended_idle:  # idle, nothing waits or runs: the next submit starts a thread
                self._end_all()

    def _end_all(self) -> None:
        """Refuse from now on, and end every request waiting or in a slot."""
        with self._wake:
            self._stopping = True
            ending = RuntimeError(self.stopped_reason)
            while self._waiting:
                self._waiting.popleft().events.put(ending)
            while self._tasks:
                self._tasks.popleft()[1].set_exception(SchedulerStoppedError(self.stopped_reason))
        for index, slot in enumerate(self._slots):
            if slot is not None:
                slot.request.events.put(ending)
                self._free(index, keep_cache=False)

    def _choose_slot(self, prompt: list[int], idle: list[int]) -> int:
        """The idle slot whose cache shares the longest prefix with prompt; with none shared,
        or between equals, the least recently used. Where a parked cache shares more, it is
        loaded into the least recently used slot (whose own cache is parked first)."""
        shared = {index: self.engine.common_prefix(index, prompt) for index in idle}
        best = max(idle, key=lambda index: (shared[index], -self._last_used[index]))
        reach = [common_prefix(held, prompt) for held, _ in self._parked]
        if reach and max(reach) > shared[best]:
            tokens, state = self._parked.pop(reach.index(max(reach)))
            target = min(idle, key=lambda index: self._last_used[index])
            self.parked_bytes -= len(state)
            self._park(target, keeping=0)
            restored = self.engine.restore_sequence(target, state, tokens)
            return target if restored else best
        self._park(best, keeping=shared[best])  # another conversation: keep this one's cache
        return best

    def _park(self, index: int, keeping: int) -> None:
        """Park slot index's cache before all but `keeping` cells go, if that loses at least
        PARK_MIN_TOKENS and the budget holds it (the least recently parked leave first)."""
        tokens = self.engine.cached(index)
        if not self.park_bytes or len(tokens) - keeping < PARK_MIN_TOKENS:
            return
        state = self.engine.sequence_state(index)
        if len(state) > self.park_bytes:
            return
        self._parked.append((tokens, state))
        self.parked_bytes += len(state)
        while self.parked_bytes > self.park_bytes:
            self.parked_bytes -= len(self._parked.pop(0)[1])

    def _admit(self) -> None:
        while self._waiting:
            idle = [index for index, slot in enumerate(self._slots) if slot is None]
            if not idle:
                return
            request = self._waiting.popleft()
            if request.cancelled.is_set():
                continue
            prompt = request.prompt_tokens
            if request.cache_prompt:
                index = self._choose_slot(prompt, idle)
                from_disk = self._restore_from_store(index, prompt)
                cached = self.engine.reuse_prefix(index, prompt)
                request.restored_tokens = cached if from_disk else 0
            else:
                index = min(idle, key=lambda i: self._last_used[i])
                self.engine.forget(index)
                cached = 0
            self._admitted += 1
            self._last_used[index] = self._admitted
            request.cached_tokens = cached
            self.reused_tokens += cached
            try:
                step = SequenceStep(
                    self.engine,
                    prompt,
                    request.max_tokens,
                    request.sampling,
                    request.stop,
                    cached_prompt_tokens=cached,
                    started=time.perf_counter(),
                    seq=index,
                    logprobs=request.logprobs,
                    post_sampling=request.post_sampling,
                )
            except Exception as error:  # this request's failure, not the server's
                request.events.put(error)
                continue
            step.restored_prompt_tokens = request.restored_tokens
            self._slots[index] = slot = _Slot(request, step, deque(prompt[cached:]))
            self._tell_progress(slot)

    def _restore_from_store(self, index: int, prompt: list[int]) -> bool:
        """Load into slot index the kept state that spares the most of prompt's prefill, where
        one is worth loading (engine.stored_state); whether it did. The slot's own cache is
        parked first."""
        found = self.engine.stored_state(index, prompt)
        restored = False
        if found is not None:
            self._park(index, keeping=0)
            restored = self.engine.load_stored(index, found)
        self._say_store_warnings()
        return restored

    # --- llama-server's slot actions, on the KV store -----------------------------------------

    def _in_loop(self, work: Callable[[], Any]) -> Any:
        """work's result, run by the loop's thread (which alone uses the context) between
        steps; its exception is raised here."""
        done: Future = Future()
        with self._wake:
            if not self.alive:
                raise SchedulerStoppedError(self.stopped_reason)
            self._tasks.append((work, done))
            if self._thread is None:
                self._start()
            self._wake.notify()
        return done.result(timeout=SLOT_ACTION_TIMEOUT_S)

    def _idle(self, index: int) -> None:
        if not 0 <= index < len(self._slots):
            raise ValueError(f"there is no slot {index}: this model has {len(self._slots)}")
        if self._slots[index] is not None:
            raise SlotBusyError(f"slot {index} is serving a request")

    def save_slot(self, index: int, name: str) -> dict[str, Any]:
        """Keep slot index's sequence in the KV store under name: llama-server's answer."""

        def work() -> dict[str, Any]:
            self._idle(index)
            tokens = self.engine.cached(index)
            if self.store is None:
                raise ValueError("this server keeps no KV store: nothing to save to")
            if not tokens:
                raise ValueError(f"slot {index} holds no tokens to save")
            started = time.perf_counter()
            written = self.store.keep_named(name, tokens, self.engine.sequence_state(index))
            self._say_store_warnings()
            if not written:
                raise OSError(f"slot {index} could not be saved (the server's log says why)")
            save_ms = (time.perf_counter() - started) * 1000
            return {"id_slot": index, "filename": name, "n_saved": len(tokens),
                    "n_written": written, "timings": {"save_ms": save_ms}}  # fmt: skip

        return self._in_loop(work)

    def restore_slot(self, index: int, name: str) -> dict[str, Any]:
        """Load what save_slot kept under name into slot index: llama-server's answer."""

        def work() -> dict[str, Any]:
            self._idle(index)
            started = time.perf_counter()
            found = self.engine.named_state(name)
            if found is None:
                raise SlotStateNotFoundError(
                    f"the KV store holds no slot state {name!r} for this model"
                )
            tokens, held, state = found
            if not self.engine.load_stored(index, (held, state)):
                self._say_store_warnings()
                raise SlotStateNotFoundError(f"llama.cpp refused the slot state {name!r}")
            self.engine.keep_prefix(index, len(tokens))
            restore_ms = (time.perf_counter() - started) * 1000
            return {"id_slot": index, "filename": name, "n_restored": len(tokens),
                    "n_read": len(state), "timings": {"restore_ms": restore_ms}}  # fmt: skip

        return self._in_loop(work)

    def erase_slot(self, index: int) -> dict[str, Any]:
        """Empty slot index's cache: llama-server's answer."""

        def work() -> dict[str, Any]:
            self._idle(index)
            erased = self.engine.cached_count(index)
            self.engine.forget(index)
            return {"id_slot": index, "n_erased": erased}

        return self._in_loop(work)

    def _say_store_warnings(self) -> None:
        if self.store is not None:
            for warning in dict.fromkeys(self.store.warnings):
                self.on_note(warning)
            self.store.warnings.clear()

    def persist(self) -> int:
        """Once closed: keep in the store every slot's and parked sequence of the store's
        min_tokens or more (before the model is unloaded); how many were kept."""
        thread = self._thread
        if self.store is None or (thread is not None and thread.is_alive()):
            return 0  # a loop that did not stop still owns the context
        sequences = [(self.engine.cached(i), i) for i in range(len(self._slots))]
        kept = 0
        for tokens, index in sequences:
            if len(tokens) >= self.store.min_tokens:
                kept += self.store.keep(tokens, self.engine.sequence_state(index)) is not None
        for tokens, state in self._parked:
            if len(tokens) >= self.store.min_tokens:
                kept += self.store.keep(tokens, state) is not None
        self._say_store_warnings()
        return kept

    def _drop_cancelled(self) -> None:
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request.cancelled.is_set():
                self._free(index)

    def _free(self, index: int, keep_cache: bool = True) -> None:
        """End slot index's request; its cells (exactly the tokens decoded so far) stay for the
        next request sharing their prefix, but after a failure."""
        slot = self._slots[index]
        if slot is None:
            return
        slot.step.close()
        if not keep_cache:
            self.engine.forget(index)
        elif self.store is not None:
            prefilled = slot.step.prompt_tokens - slot.request.cached_tokens
            if prefilled >= self.store.keep_after_prefill:  # quill run's rule: a long prompt
                self.store.keep(self.engine.cached(index), self.engine.sequence_state(index))
                self._say_store_warnings()
        self._slots[index] = None

    def _step(self) -> None:
        """One decode over every busy slot: decode tokens first, then prompt chunks."""
        capacity = self.engine.n_batch
        items: list[tuple[int, int, bool]] = []
        owners: list[_Slot] = []
        busy = [(index, slot) for index, slot in enumerate(self._slots) if slot is not None]
        for index, slot in busy:
            slot.output = -1
            if not slot.pending and slot.step.generated:  # decoding: feed back the last token
                items.append((index, slot.last_token, True))
                owners.append(slot)
        prefilling = []
        for index, slot in busy:
            if slot.pending and len(items) < capacity:
                prefilling.append(slot)
            while slot.pending and len(items) < capacity:
                token = slot.pending.popleft()
                items.append((index, token, not slot.pending))
                owners.append(slot)
        try:
            outputs = self.engine.decode(items)
        except DecodeError as error:
            for index, slot in busy:
                slot.request.events.put(error)
                self._free(index, keep_cache=False)
            return
        for slot, output in zip(owners, outputs, strict=True):
            if output >= 0:
                slot.output = output
        self.steps += 1
        self.sequences_stepped += len(busy)
        self.max_sequences_in_a_step = max(
            self.max_sequences_in_a_step, sum(slot.output >= 0 for _, slot in busy)
        )
        for slot in prefilling:
            self._tell_progress(slot)
        for index, slot in busy:
            if slot.output >= 0:
                try:
                    self._sample(index, slot)
                except Exception as error:  # this request's failure, not the server's
                    slot.request.events.put(error)
                    self._free(index, keep_cache=False)

    @staticmethod
    def _tell_progress(slot: _Slot) -> None:
        request, step = slot.request, slot.step
        if request.progress:
            done = step.prompt_tokens - len(slot.pending)
            prefilled = done > step.cached_prompt_tokens  # no time before the first batch
            elapsed_s = time.perf_counter() - step.started if prefilled else 0.0
            request.events.put(
                PromptProgress(step.prompt_tokens, step.cached_prompt_tokens, done, elapsed_s)
            )

    def _sample(self, index: int, slot: _Slot) -> None:
        event = slot.step.sample(slot.output)
        slot.last_token = event.token if event.token is not None else -1
        slot.request.events.put(event)
        if event.finish_reason is not None:
            self._free(index)

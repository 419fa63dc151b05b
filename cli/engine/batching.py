"""Continuous batching: several sequences share each llama_decode step, as serving engines do.

One thread owns the llama.cpp context and loops: admit waiting requests into free sequence slots,
build one batch holding the next token of every decoding sequence plus as much of the waiting
prompts as the batch has room for, decode it, sample every sequence that got logits, hand each
its event. A request that finishes or is cancelled leaves at once and frees its slot; a new one
joins at the next step. Each slot has its own KV cells (sequence id), its own sampler chain and
its own text stream, so requests do not see each other, but share every matrix multiplication.

Consumers get the same StreamEvent objects Engine.stream_generate yields.
"""

from __future__ import annotations

import queue
import random
import resource
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import llama_cpp as llama

from cli.engine.engine import Engine, StreamEvent, sampler_chain
from cli.engine.llamalog import llama_log
from cli.engine.sampling import SamplingParams
from cli.engine.textstream import TextStream


class QueueFullError(Exception):
    """More requests are waiting than the server accepts; the client should retry later."""


@dataclass
class BatchRequest:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    events: queue.Queue[StreamEvent | BaseException] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def stream(self) -> Iterator[StreamEvent]:
        """The events of this request, as they are made; the last has finish_reason set."""
        while True:
            item = self.events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


@dataclass
class _Slot:
    seq_id: int
    request: BatchRequest
    sampler: object
    text: TextStream
    seed: int
    admitted_at: float
    pending: deque[int]  # prompt tokens not yet decoded
    position: int = 0  # next KV position of this sequence
    generated: int = 0
    prefill_s: float = 0.0
    first_token_at: float = 0.0
    output_index: int = -1  # where this slot's logits are in the last batch, or -1
    last_token: int = -1


class BatchScheduler:
    """Owns the engine's context from a thread of its own; submit() from any thread."""

    def __init__(self, engine: Engine, max_queued: int = 16) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self._waiting: deque[BatchRequest] = deque()
        self._slots: list[_Slot | None] = [None] * engine.parallel
        self._wake = threading.Condition()
        self._stopping = False
        self.steps = 0
        self.max_sequences_in_a_step = 0
        self._thread = threading.Thread(target=self._loop, name="quill-batch", daemon=True)
        self._thread.start()

    # --- what other threads call ------------------------------------------------------------

    def submit(self, request: BatchRequest) -> BatchRequest:
        with self._wake:
            if len(self._waiting) >= self.max_queued:
                raise QueueFullError(
                    f"{len(self._waiting)} requests are already waiting; retry shortly"
                )
            self._waiting.append(request)
            self._wake.notify()
        return request

    @property
    def busy_slots(self) -> int:
        return sum(slot is not None for slot in self._slots)

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # --- the loop ---------------------------------------------------------------------------

    def _loop(self) -> None:
        batch = llama.llama_batch_init(self.engine.n_batch, 0, 1)
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._waiting and not self.busy_slots:
                        self._wake.wait()
                    if self._stopping:
                        return
                    self._admit()
                self._drop_cancelled()
                if self.busy_slots:
                    self._step(batch)
        finally:
            llama.llama_batch_free(batch)
            for index, slot in enumerate(self._slots):
                if slot is not None:
                    slot.request.events.put(RuntimeError("the server is shutting down"))
                    self._free(index)

    def _admit(self) -> None:
        for index, slot in enumerate(self._slots):
            if slot is not None or not self._waiting:
                continue
            request = self._waiting.popleft()
            if request.cancelled.is_set():
                continue
            sampling = request.sampling
            seed = sampling.seed if sampling.seed is not None else random.randrange(2**31)
            memory = llama.llama_get_memory(self.engine.llama_context)
            llama.llama_memory_seq_rm(memory, index, -1, -1)
            banned = self.engine.eog_tokens if sampling.ignore_eos else ()
            sampler = sampler_chain(
                sampling, seed, request.prompt_tokens, banned, self.engine.n_vocab
            )
            self._slots[index] = _Slot(
                seq_id=index,
                request=request,
                sampler=sampler,
                text=TextStream(request.stop),
                seed=seed,
                admitted_at=time.perf_counter(),
                pending=deque(request.prompt_tokens),
            )

    def _drop_cancelled(self) -> None:
        for index, slot in enumerate(self._slots):
            if slot is not None and slot.request.cancelled.is_set():
                self._free(index)

    def _free(self, index: int) -> None:
        slot = self._slots[index]
        if slot is None:
            return
        llama.llama_sampler_free(slot.sampler)
        llama.llama_memory_seq_rm(llama.llama_get_memory(self.engine.llama_context), index, -1, -1)
        self._slots[index] = None

    def _step(self, batch: llama.llama_batch) -> None:
        """One llama_decode over every busy slot: decode tokens first, then prompt chunks."""
        capacity = self.engine.n_batch
        n = 0

        def add(slot: _Slot, token: int, wants_logits: bool) -> None:
            nonlocal n
            batch.token[n] = token
            batch.pos[n] = slot.position
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = slot.seq_id
            batch.logits[n] = wants_logits
            if wants_logits:
                slot.output_index = n
            slot.position += 1
            n += 1

        busy = [slot for slot in self._slots if slot is not None]
        for slot in busy:
            slot.output_index = -1
            if not slot.pending and slot.generated:  # decoding: feed back the last token
                add(slot, slot.last_token, True)
        for slot in busy:
            while slot.pending and n < capacity:
                token = slot.pending.popleft()
                add(slot, token, not slot.pending)
        batch.n_tokens = n
        status = llama.llama_decode(self.engine.llama_context, batch)
        if status != 0:
            problems = "; ".join(llama_log().drain()[-2:])
            error = RuntimeError(f"llama_decode failed with status {status}: {problems}")
            for slot in busy:
                slot.request.events.put(error)
                self._free(slot.seq_id)
            return
        self.steps += 1
        self.max_sequences_in_a_step = max(
            self.max_sequences_in_a_step, sum(s.output_index >= 0 for s in busy)
        )
        now = time.perf_counter()
        for slot in busy:
            if slot.output_index >= 0:
                self._sample(slot, now)

    def _sample(self, slot: _Slot, now: float) -> None:
        engine = self.engine
        token = llama.llama_sampler_sample(slot.sampler, engine.llama_context, slot.output_index)
        slot.generated += 1
        if slot.generated == 1:
            slot.prefill_s = now - slot.admitted_at
            slot.first_token_at = now
        slot.last_token = token
        request = slot.request
        at_limit = slot.generated >= request.max_tokens or slot.position >= engine.n_ctx
        released, finish = engine.accept(token, slot.text, at_limit)
        request.events.put(
            StreamEvent(
                text=released,
                token=token,
                prompt_tokens=len(request.prompt_tokens),
                cached_prompt_tokens=0,
                prefill_s=slot.prefill_s,
                generation_tokens=slot.generated,
                decode_s=now - slot.first_token_at,
                finish_reason=finish,
                stop_string=slot.text.matched_stop,
                seed=slot.seed,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            )
        )
        if finish is not None:
            self._free(slot.seq_id)

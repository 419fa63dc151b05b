"""quill serve's scheduler for an embedding or rerank model: one thread owns the Embedder;
requests wait in a queue, and every request waiting when a pass starts is embedded in that pass,
their texts packed together into each decode (concurrent clients share batches)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from cli.engine.batching import SchedulerStoppedError
from cli.engine.embedding import EUCLIDEAN, Embedder, Embedding
from cli.errors import QueueFullError


@dataclass
class EmbeddingJob:
    """One request's texts (token lists that fit the model); results in their order."""

    texts: Sequence[Sequence[int]]
    done: threading.Event = field(default_factory=threading.Event)
    results: list[Embedding] = field(default_factory=list)
    error: BaseException | None = None


class EmbeddingScheduler:
    def __init__(self, embedder: Embedder, max_queued: int = 64) -> None:
        self.engine = embedder  # as the pool names a scheduler's model
        self.max_queued = max_queued
        self.failure: BaseException | None = None
        self.steps = 0  # passes run (health's decode_steps)
        self.max_sequences_in_a_step = 0
        self._jobs: list[EmbeddingJob] = []
        self._running: list[EmbeddingJob] = []
        self._lock = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="quill-embed", daemon=True)
        self._thread.start()

    @property
    def busy_slots(self) -> int:
        return 1 if self._running else 0

    @property
    def queued(self) -> int:
        return len(self._jobs)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    @property
    def stopped_reason(self) -> str:
        if self.failure is not None:
            return f"the embedding scheduler stopped on an error: {self.failure!r}"
        return "the embedding scheduler has shut down"

    def submit(self, job: EmbeddingJob) -> None:
        with self._lock:
            if not self.alive:
                raise SchedulerStoppedError(self.stopped_reason)
            if len(self._jobs) >= self.max_queued:
                raise QueueFullError(len(self._jobs))
            self._jobs.append(job)
            self._lock.notify_all()

    def run(self, job: EmbeddingJob) -> list[Embedding]:
        """Submit job and wait for it (on a worker thread, never the event loop)."""
        self.submit(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.results

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if self._closed:
                    break
                self._running, self._jobs = self._jobs, []
            try:
                self._pass(self._running)
            except Exception as error:  # a failed decode: these jobs fail, the next may not
                for job in self._running:
                    job.error = error
            finally:
                for job in self._running:
                    job.done.set()
                self._running = []
        self._fail_waiting(SchedulerStoppedError(self.stopped_reason))

    def _pass(self, jobs: list[EmbeddingJob]) -> None:
        """Embed every job's texts in one stream of decodes (L2-normalized, as OpenAI's are)."""
        owners = [job for job in jobs for _ in job.texts]
        texts = (text for job in jobs for text in job.texts)
        for owner, result in zip(owners, self.engine.embed(texts, EUCLIDEAN), strict=True):
            # Numbered within its own request: the pass counts over every request in it.
            owner.results.append(replace(result, index=len(owner.results)))
        self.steps += 1
        self.max_sequences_in_a_step = max(self.max_sequences_in_a_step, len(owners))

    def _fail_waiting(self, error: BaseException) -> None:
        with self._lock:
            jobs, self._jobs = self._jobs, []
        for job in jobs:
            job.error = error
            job.done.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def persist(self) -> int:
        return 0  # an embedding model keeps no conversation to store

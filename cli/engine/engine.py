"""The one engine: load a GGUF through llama.cpp's C API, prefill, decode, stream events
(Engine.stream_generate; every command renders what it yields). Nothing here prints or exits.

Engine is the façade the commands, the server and the scheduler hold; the work is in rooms of
its own: loading.py (the model), context.py (the llama_context and its warm-up), vocabulary.py
(tokens and the chat-template glue), kvcache.py (the cells each sequence holds, the prompt
cache), tokenstep.py (a sampled token's event), samplerchain.py and logprobs.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import llama_cpp as llama
import numpy as np

from cli.engine.context import context_params, refuse_impossible_kv_types, warm_up
from cli.engine.events import StreamEvent, TokenLogprobs
from cli.engine.freecores import CoreLoad, ThreadJudge, measure_free_cores
from cli.engine.grammar import GrammarGate
from cli.engine.kvcache import (
    EXACT_BATCH,
    KvCache,
    keep_in_prompt_cache,
    load_stored,
    named_state,
    restore_from_prompt_cache,
    stored_state,
)
from cli.engine.llamalog import llama_log
from cli.engine.loading import load_failure, model_meta, refuse_non_gguf
from cli.engine.logprobs import token_logprobs
from cli.engine.options import LoadOptions, context_size
from cli.engine.reasoning import split_reasoning, think_within_budget
from cli.engine.sampling import SamplingParams
from cli.engine.settings import ModelSettings, PromptCache
from cli.engine.shelf import open_model
from cli.engine.templates import Message
from cli.engine.tokenstep import SequenceStep
from cli.engine.vocabulary import (
    Vocabulary,
    may_open_with_reasoning,
    model_template,
    plain_conversation,
    render_chat,
)
from cli.errors import ContextOverflowError, KvCacheTypeError
from quant.gguf import head_dims
from quant.kv import kv_cache_bytes

DEFAULT_SAMPLING = SamplingParams()
NO_SETTINGS = ModelSettings()  # the model's own template, no speculation, cache or logprobs


class Speculator(Protocol):  # cli/engine/speculative.py's
    last_stats: Any  # SpecStats of the last reply

    def decode(
        self, engine: Engine, step: SequenceStep, output: int, sampling: SamplingParams
    ) -> Iterator[StreamEvent]: ...

    def close(self) -> None: ...

    def set_threads(self, threads: int) -> None: ...  # a draft model follows its target's


class Engine:
    """A loaded model, its context and its sequences (sequence 0 is stream_generate's)."""

    def __init__(
        self,
        path: Path,
        options: LoadOptions = LoadOptions(),
        verbose: bool = False,
        settings: ModelSettings = NO_SETTINGS,
        *,
        family: str | None = None,
        on_note: Callable[[str], None] | None = None,
    ):
        """Load path with options and settings but settings.spec (cli/engine/opening.py attaches
        it); family: the template family models.yaml names; on_note tells the user a line."""
        log = llama_log()
        log.verbose = verbose
        log.drain()
        refuse_non_gguf(path)
        started = time.perf_counter()
        self._handle = open_model(path, options)
        self.from_shelf = self._handle.from_shelf  # its weights still mapped: no load of the file
        loaded = self._handle.loaded
        self.path, self.rpc, self.cpu_path = path, options.rpc, loaded.cpu_path
        self.weights_placement = options.placement_shown  # "" where llama.cpp's rule held
        self._model: Any = loaded.model  # a llama_model pointer; None once freed
        self._read_model(options)
        self._open_context(options)
        self.load_s = time.perf_counter() - started

        model = self._model
        plain = not (
            llama.llama_model_n_swa(model) > 0
            or llama.llama_model_is_recurrent(model)
            or llama.llama_model_is_hybrid(model)
        )
        self.kv = KvCache(
            self._ctx, self.parallel, self.n_ctx, self.n_batch, self._look_at_cores, plain
        )
        self.restored_tokens = 0  # prompt tokens of the last request loaded from prompt_cache
        self.restore_s = 0.0
        self.prefilled_tokens = 0  # prompt tokens the last request decoded
        self.notes: list[str] = []
        self.on_note = on_note
        self.enable_thinking = settings.think  # the template's switch; None: its default
        self.think_budget = settings.think_budget  # reasoning tokens before the block closes
        self.logprobs = settings.logprobs  # the server asks per request (BatchRequest.logprobs)
        chosen, think = settings.chat_template, settings.think
        self.chat_template, notes = model_template(
            self.vocabulary, self.meta, self.architecture, chosen, family, think
        )
        for line in notes:
            self.note(line)
        self.prompt_cache: PromptCache | None = (
            settings.prompt_cache(self) if settings.prompt_cache else None
        )
        self.speculator: Speculator | None = None  # set by cli/engine/speculative.py's attach

    def _read_model(self, options: LoadOptions) -> None:
        """What the model is, fixed once it is loaded; KV types its heads cannot hold refused."""
        model = self._model
        self.vocabulary = vocabulary = Vocabulary(model)
        self.vocab_handle = self._vocab = vocabulary.handle
        self.n_layers = llama.llama_model_n_layer(model)
        self.n_vocab = vocabulary.n_vocab
        self.architecture = self.meta("general.architecture") or "unknown"
        self.head_dims = head_dims(lambda key, default: self.meta(key) or default)  # (K, V)
        # A recurrent state's cells cannot be partly removed.
        self.is_recurrent = bool(
            llama.llama_model_is_recurrent(model) or llama.llama_model_is_hybrid(model)
        )
        self.add_bos, self.bos_token = vocabulary.add_bos, vocabulary.bos_token
        self.gpu_layers = (
            min(options.gpu_layers, self.n_layers) if options.gpu_layers >= 0 else self.n_layers
        )
        self.kv_type_k, self.kv_type_v = options.kv_type_k, options.kv_type_v
        try:
            refuse_impossible_kv_types(self.kv_type_k, self.kv_type_v, self.head_dims)
        except KvCacheTypeError:
            self.close()
            raise

    def _open_context(self, options: LoadOptions) -> None:
        """The context of options.parallel sequences, its threads chosen, warmed up (but for a
        model off the shelf)."""
        self.trained_ctx = llama.llama_model_n_ctx_train(self._model)
        n_ctx = context_size(options.n_ctx, self.trained_ctx)
        # Automatic (no --threads): one per physical core that other processes leave free,
        # judged again while decoding (freecores.ThreadJudge).
        self.thread_judge: ThreadJudge | None = None
        self.threads = options.threads or self._judge_threads()
        params = context_params(options, n_ctx, self.threads)
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise load_failure(self.path, llama_log().drain())
        # A model off the shelf had its weights touched by its first context: a warm-up there
        # added 0.1 s to a 1B-class reload and made the first prefill no faster.
        if not self.from_shelf:
            warm_up(self._model, self._ctx, (self.bos_token, self.vocabulary.eos_token))
        self.parallel = options.parallel
        self.n_ctx = llama.llama_n_ctx_seq(self._ctx)  # positions one sequence can hold
        self.n_batch = params.n_batch

    @property
    def core_load(self) -> CoreLoad | None:  # the last look's; None: a fixed thread count
        return self.thread_judge.load if self.thread_judge else None

    def set_threads(self, threads: int | None) -> None:
        """Decode with threads from the next decode on; None: automatic again."""
        self.thread_judge = None
        self._use_threads(threads or self._judge_threads())

    def _judge_threads(self) -> int:
        """Threads from now on judged by the cores other processes leave free."""
        self.thread_judge = ThreadJudge(measure_free_cores())
        return self.thread_judge.threads

    def _use_threads(self, threads: int) -> None:
        self.threads = threads
        llama.llama_set_n_threads(self._ctx, threads, threads)
        if self.speculator is not None:
            self.speculator.set_threads(threads)

    def _look_at_cores(self) -> None:
        if self.thread_judge is not None and self.thread_judge.look():
            self._use_threads(self.thread_judge.threads)  # another process took or freed a core

    def meta(self, key: str) -> str | None:
        return model_meta(self._model, key)

    @property
    def continues_text(self) -> bool:
        """Whether the model predicts a next token: an embedding model or reranker (a pooling
        declared, or attention that sees the whole text) reads a text whole instead. From the
        metadata llama.cpp already read, so that a chat model's start pays nothing for it."""
        pooling = self.meta(f"{self.architecture}.pooling_type")
        causal = self.meta(f"{self.architecture}.attention.causal")
        return pooling in (None, "0") and causal != "false"

    @property
    def kv_cache_bytes(self) -> int:
        (k, v), heads = self.head_dims, llama.llama_model_n_head_kv(self._model)
        cells = self.n_ctx * self.parallel
        return kv_cache_bytes(self.n_layers, heads, k, cells, self.kv_type_k, self.kv_type_v, v)

    @property
    def llama_version(self) -> str:
        """The llama.cpp build: a saved state is only valid for the build that wrote it."""
        return f"llama-cpp-python {llama.__version__}"

    def perf(self) -> dict[str, float]:
        """llama.cpp's own counters for the last request."""
        data = llama.llama_perf_context(self._ctx)
        names = ("t_load_ms", "t_p_eval_ms", "t_eval_ms", "n_p_eval", "n_eval")
        return {name: getattr(data, name) for name in names}

    def perf_note(self) -> str:
        return f"llama.cpp perf: {self.perf()}\nCPU path: {self.cpu_path.describe()}"

    @property
    def eog_tokens(self) -> tuple[int, ...]:
        return self.vocabulary.eog_tokens

    def is_end_of_generation(self, token: int) -> bool:
        return self.vocabulary.is_end_of_generation(token)

    def is_special_token(self, text: str) -> bool:
        """Whether text is one control or user-defined token of the vocabulary."""
        return self.vocabulary.is_special_token(text)

    def tokenize(self, text: str) -> list[int]:
        return self.vocabulary.tokenize(text)

    def respell(self, tokens: Sequence[int], like: Sequence[int]) -> list[int]:
        """tokens (of a text) led by as many of like as spell the same bytes (Vocabulary's)."""
        return self.vocabulary.respell(tokens, like)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token, whatever their length (llama-cpp-python's helper cuts at 32)."""
        return self.vocabulary.piece(token, special)

    def note(self, line: str) -> None:
        """A line for the user (a template fallback), told once through on_note."""
        if line not in self.notes:
            self.notes.append(line)
            if self.on_note is not None:
                self.on_note(line)

    def chat_prompt(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> str | None:
        """The conversation rendered with the chat template; None without one."""
        template = self.chat_template
        if template is None:
            return None
        thinking = self.enable_thinking if enable_thinking is None else enable_thinking
        rendered = render_chat(self.vocabulary, template, messages, tools, thinking)
        if rendered.note:
            self.note(rendered.note)
        return rendered.text

    def conversation_text(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None = None,
        enable_thinking: bool | None = None,
    ) -> tuple[str, bool]:
        """The conversation as the model reads it, and whether its chat template made it; without
        one, a 'role: text' line per message and 'assistant: ' (base models continue text)."""
        templated = self.chat_prompt(messages, tools, enable_thinking)
        if templated is not None:
            return templated, True
        return plain_conversation(messages), False

    @property
    def reasoning_may_open(self) -> bool:
        """Whether a reply may start with a reasoning block (a grammar then holds the answer)."""
        return may_open_with_reasoning(self.chat_template)

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return len(self.tokenize(self.conversation_text(messages)[0]))

    # The Backend protocol: this process runs the model, and so does all of it.
    server_url = None
    manages_window = samples_here = reports_runtime = True

    @property
    def speculation_stats(self) -> Any:  # SpecStats of the last reply; None without speculation
        return self.speculator.last_stats if self.speculator is not None else None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def location(self) -> str:
        return str(self.path)

    def stream_chat(
        self,
        messages: Sequence[tuple[str, str]],
        max_tokens: int,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        stop: Sequence[str] = (),
    ) -> Iterator[StreamEvent]:
        """The reply to a conversation, templated, its reasoning apart (cli/engine/reasoning.py)."""
        prompt = self.conversation_text(messages)[0]
        events = self.stream_text(prompt, max_tokens, sampling, stop)
        if self.think_budget is not None:
            budget = self.think_budget
            return think_within_budget(self, prompt, events, budget, max_tokens, sampling, stop)
        return split_reasoning(events, prompt)

    def stream_text(
        self,
        text: str,
        max_tokens: int,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        stop: Sequence[str] = (),
    ) -> Generator[StreamEvent, None, None]:
        """A continuation of text as it is (no template), checked against the context window."""
        tokens = self.tokenize(text)
        if len(tokens) + max_tokens > self.n_ctx:
            raise ContextOverflowError(len(tokens), max_tokens, self.n_ctx, self.trained_ctx)
        # A run's saved prompt is exact: its tokens stay as the text tokenizes.
        respell = not (self.prompt_cache and self.prompt_cache.exact)
        return self.stream_generate(tokens, max_tokens, sampling, stop, respell)

    def stream_generate(
        self,
        prompt_tokens: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams = DEFAULT_SAMPLING,
        stop: Sequence[str] = (),
        respell: bool = False,  # the tokens are a text's: the cells' spelling of it may lead
    ) -> Generator[StreamEvent, None, None]:
        """One sequence (0) from prompt to finish: prefill, then one SequenceStep per token."""
        if not prompt_tokens:
            raise ValueError("the prompt has no tokens")
        llama.llama_perf_context_reset(self._ctx)
        started = time.perf_counter()
        self._load_prompt_cache(prompt_tokens)
        if respell:
            prompt_tokens = self.respell(prompt_tokens, self.kv.cached(0))
        exact = self.restored_tokens and self.prompt_cache and self.prompt_cache.exact
        cached, output = self.prefill(prompt_tokens, EXACT_BATCH if exact else 1)
        self.restored_tokens = cached if self.restored_tokens else 0  # all from the file
        self.prefilled_tokens = len(prompt_tokens) - cached
        step = SequenceStep(
            self, prompt_tokens, max_tokens, sampling, stop, cached, started, logprobs=self.logprobs
        )
        step.restored_prompt_tokens = self.restored_tokens
        try:
            # llama_decode may return while an asynchronous backend (a GPU, RPC servers) still
            # computes: the prefill ends when its results are in.
            llama.llama_synchronize(self._ctx)
            step.prefill_s = time.perf_counter() - started
            # A grammar's state follows each sampled token: speculation's acceptance test reads
            # the plain chain's probabilities and would bypass it, so constrained replies decode
            # one token at a time. Logprobs are read from each token's own logits: the same.
            if self.speculator is not None and not sampling.grammar and self.logprobs is None:
                yield from self.speculator.decode(self, step, output, sampling)
                return
            while True:
                event = step.sample(output)
                yield event
                if event.finish_reason is not None:
                    return
                assert event.token is not None  # every sampled token's event carries it
                output = self.decode([(0, event.token, True)])[0]
        finally:
            step.close()

    def prefill(self, tokens: Sequence[int], decode_at_least: int = 1) -> tuple[int, int]:
        """Keep sequence 0's common prefix with tokens and decode the rest in batches; (tokens
        kept, the output of the last). Never ends on a short chunk where the batch can hold two
        long ones (EXACT_BATCH)."""
        kept = self.reuse_prefix(0, tokens, decode_at_least)
        pending, output = list(tokens[kept:]), -1
        while pending:
            size = self.n_batch
            if size >= 2 * EXACT_BATCH and 0 < len(pending) - size < EXACT_BATCH:
                size = len(pending) - EXACT_BATCH
            chunk, pending = pending[:size], pending[size:]
            items = [
                (0, token, not pending and i == len(chunk) - 1) for i, token in enumerate(chunk)
            ]
            output = self.decode(items)[-1]
        return kept, output

    def sample(
        self,
        sampler: object,
        output: int,
        grammar: GrammarGate | None = None,
        free: Callable[[int], bool] | None = None,
    ) -> int:
        """The token a sampler chain picks from the logits of output (of the last decode); within
        grammar where one is given, free: what it lets through unchecked (GrammarGate.sample)."""
        if grammar is not None:
            return grammar.sample(sampler, self._ctx, output, free)
        return llama.llama_sampler_sample(sampler, self._ctx, output)

    def token_logprobs(self, logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
        """token's log-probability under logits, and the top most likely (ties by token id)."""
        return token_logprobs(logits, token, top, self.piece)

    def output_logits(self, output: int) -> np.ndarray:
        """The logits of one output of the last decode (a copy)."""
        pointer = llama.llama_get_logits_ith(self._ctx, output)
        return np.ctypeslib.as_array(pointer, (self.n_vocab,)).copy()

    def window_logits(self, tokens: Sequence[int], first_scored: int) -> np.ndarray:
        """Logits after each of tokens[first_scored:] from a fresh cache (row i predicts
        tokens[first_scored + i + 1]: what perplexity scores)."""
        if len(tokens) > self.n_ctx:
            raise ValueError(f"a window of {len(tokens)} tokens exceeds the context {self.n_ctx}")
        self.clear_cache()
        rows: list[np.ndarray] = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            items = [(0, token, start + i >= first_scored) for i, token in enumerate(chunk)]
            self.decode(items)
            scored = sum(wants for _, _, wants in items)
            if scored:
                pointer = llama.llama_get_logits(self._ctx)
                rows.append(np.ctypeslib.as_array(pointer, (scored, self.n_vocab)).copy())
        return np.concatenate(rows)

    def decode(self, items: Sequence[tuple[int, int, bool]]) -> list[int]:
        """One llama_decode of (sequence, token, wants logits) items, each at its sequence's next
        position; each item's output index (-1: none). On DecodeError the sequences are empty."""
        return self.kv.decode(items)

    def cached(self, seq: int = 0) -> list[int]:
        """The tokens whose KV cells sequence seq holds, in position order (a copy)."""
        return self.kv.cached(seq)

    def cached_count(self, seq: int = 0) -> int:
        return self.kv.cached_count(seq)

    @property
    def cached_tokens(self) -> int:  # sequence 0's positions a next prompt may reuse
        return self.kv.cached_count(0)

    def common_prefix(self, seq: int, tokens: Sequence[int]) -> int:
        """How many leading tokens of tokens sequence seq already holds (nothing changes)."""
        return self.kv.common_prefix(seq, tokens)

    def keep_prefix(self, seq: int, n: int) -> None:
        """Keep sequence seq's first n KV cells and free the rest (the one place cells go)."""
        self.kv.keep_prefix(seq, n)

    def reuse_prefix(self, seq: int, tokens: Sequence[int], decode_at_least: int = 1) -> int:
        """Keep seq's common prefix with tokens, but the last decode_at_least (one at least, for
        logits to sample); the number kept."""
        return self.kv.reuse_prefix(seq, tokens, decode_at_least)

    def forget(self, seq: int) -> None:
        self.kv.forget(seq)

    def clear_cache(self) -> None:
        self.kv.clear()

    def sequence_state(self, seq: int = 0) -> bytearray:
        """Sequence seq's KV cells as llama.cpp serializes them (for restore_sequence)."""
        return self.kv.sequence_state(seq)

    def restore_sequence(self, seq: int, state: bytes | bytearray, tokens: Sequence[int]) -> bool:
        """Replace sequence seq's cells with a saved state of tokens; False (seq empty) when
        llama.cpp refuses it or it holds other than len(tokens) positions."""
        return self.kv.restore_sequence(seq, state, tokens)

    def stored_state(self, seq: int, tokens: Sequence[int]) -> tuple[list[int], bytes] | None:
        """The prompt cache's state that would spare sequence seq the most prefill of tokens
        (kvcache.stored_state); None where none is worth loading."""
        return stored_state(self.prompt_cache, self.kv, seq, tokens)

    def named_state(self, name: str) -> tuple[list[int], list[int], bytes] | None:
        """What the prompt cache keeps under name (llama-server's slot save), if it fits."""
        return named_state(self.prompt_cache, self.kv, name)

    def load_stored(self, seq: int, found: tuple[list[int], bytes]) -> bool:
        """Load what stored_state found into sequence seq (a refused state leaves the store)."""
        return self.prompt_cache is not None and load_stored(self.prompt_cache, self.kv, seq, found)

    def _load_prompt_cache(self, tokens: Sequence[int]) -> None:
        # Reset first: a lookup that raises leaves no numbers of the request before.
        self.restored_tokens, self.restore_s = 0, 0.0
        restored = restore_from_prompt_cache(self.prompt_cache, self.kv, tokens)
        self.restored_tokens, self.restore_s = restored

    def keep_prompt_cache(self, always: bool = False) -> None:
        """Save sequence 0 to the prompt cache if the last request prefilled a long prompt (or,
        always, if it holds one: a chat leaving)."""
        keep_in_prompt_cache(self.prompt_cache, self.kv, self.prefilled_tokens, always)

    def close(self, shelve: bool = False) -> None:
        """Free the context and the model; shelve: put the model on the shelf (shelf.py) where
        its weights are its file's pages, for a later Engine of the same file to take back."""
        # getattr: close() also runs where __init__ failed before setting everything.
        speculator = getattr(self, "speculator", None)
        if speculator is not None:
            speculator.close()
            self.speculator = None
        kv = getattr(self, "kv", None)
        if kv is not None:
            kv.close()
        if getattr(self, "_ctx", None):
            llama.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self._handle.close(shelve)
            self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

"""One sequence's grammar in the token step, as llama.cpp's common sampler applies it
(common/sampling.cpp, common_sampler_sample): masking the whole vocabulary walks every candidate
through the grammar's stacks (llama.cpp issues 4218, 7554), so the plain chain samples first, only
its token is tested, and only a refused token costs a masked resample.

That resample masks a shortlist of the SHORTLIST highest logits first where the chain keeps only
its top k (greedy: k = 1) and no penalty reorders logits: if k of them pass, the chain's top-k cut
of the shortlist holds exactly the tokens the full mask would leave, in the same order (the same
seed picks the same token). Only when fewer pass is the whole vocabulary masked.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import resource
import signal
import time
from collections.abc import Callable

import llama_cpp as llama
import numpy as np

from cli.engine.gbnf import GrammarError, safe_grammar
from cli.engine.llamalog import llama_log
from cli.engine.samplerchain import TOKEN_DATA
from cli.errors import InvalidOutputError


class GrammarDeadEnd(InvalidOutputError):
    """The grammar allows no token of the vocabulary at this point: llama.cpp would abort the
    process on the next accept, so the reply ends here instead."""


class GrammarTooSlow(InvalidOutputError):
    """One token's grammar work took longer than GRAMMAR_STEP_SECONDS: an ambiguous grammar
    multiplies llama.cpp's parse stacks with every token, and the next steps would be slower."""


# The longest one token's grammar work may take (a schema's grammar takes well under 10 ms).
GRAMMAR_STEP_SECONDS = 1.0

# How long a trial build of a grammar in a child process may take, and how much memory it may
# add (the server's check_grammar): a grammar quill's checks let through that still crashes or
# swells llama.cpp costs that child, not the server.
TRIAL_SECONDS = 3.0
TRIAL_MEMORY_BYTES = 1 << 30


# The grammar as quill hands it to llama.cpp (cli/engine/gbnf.py), or GrammarError.
checked_grammar = functools.lru_cache(maxsize=64)(safe_grammar)


def grammar_sampler(vocab: object, grammar: str) -> object:
    """llama.cpp's grammar sampler for GBNF text with a root rule, or GrammarError. The text
    goes through quill's checks, then a trial build in a child process (once per text): a
    grammar that still crashes, hangs or swells llama.cpp costs that child."""
    text = checked_grammar(grammar)
    tried_grammar(vocab, text)
    log = llama_log()
    log.drain()
    sampler = llama.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
    if not sampler:
        problems = [line for line in log.drain() if line.strip()]
        reason = "; ".join(problems[-2:]) or "llama.cpp gave no reason"
        raise GrammarError(f"llama.cpp cannot parse the grammar: {reason}")
    return sampler


def check_grammar(vocab: object, grammar: str) -> None:
    """GrammarError unless llama.cpp builds the grammar (a server checks before queueing)."""
    llama.llama_sampler_free(grammar_sampler(vocab, grammar))


# The trial's walk: steps of tokens the grammar allows among a sample of the vocabulary. An
# ambiguous grammar (.* beside recursion) multiplies llama.cpp's parse stacks with each token:
# one such grammar took 3 s for a token's mask, then 17 s for one accept. The walk finds that
# while the cost is still small, and the grammar is refused.
TRIAL_STEPS = 12
TRIAL_SAMPLE = 256
_tried: dict[str, str | None] = {}


def tried_grammar(vocab: object, text: str) -> None:
    """GrammarError unless a trial child builds and walks text's grammar in time (once per text:
    a server's many requests with one schema pay once)."""
    if text not in _tried:
        if len(_tried) > 256:
            _tried.clear()
        _tried[text] = _trial_in_child(vocab, text)
    problem = _tried[text]
    if problem is not None:
        raise GrammarError(problem)


def _trial_walk(vocab: object, sampler: object) -> None:
    """A few tokens through the grammar, as sampling would take them (in the trial child)."""
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    sample = np.zeros(min(TRIAL_SAMPLE, n_vocab), dtype=TOKEN_DATA)
    array = llama.llama_token_data_array(data=sample.ctypes.data_as(llama.llama_token_data_p))
    buffer = ctypes.create_string_buffer(256)
    for step in range(TRIAL_STEPS):
        sample["id"] = (np.arange(len(sample)) * 7919 + step * 104729) % n_vocab
        sample["logit"], sample["p"] = 0.0, 0.0
        array.size, array.selected = len(sample), -1
        llama.llama_sampler_apply(sampler, ctypes.byref(array))
        passed = sample["id"][sample["logit"] != -np.inf].tolist()
        allowed = [t for t in passed if not llama.llama_vocab_is_eog(vocab, t)]
        if not allowed:
            return
        # The longest piece: the most characters through the grammar's stacks at once, where
        # an ambiguous grammar multiplies them fastest.
        longest = max(
            allowed, key=lambda t: llama.llama_token_to_piece(vocab, t, buffer, 256, 0, True)
        )
        llama.llama_sampler_accept(sampler, longest)


def _trial_in_child(vocab: object, text: str) -> str | None:
    """Why building text's grammar (and walking it a few tokens) failed in a child process,
    or None when it was built (or llama.cpp refused it: grammar_sampler then says why)."""
    pid = os.fork()
    if pid == 0:  # the child: build, report by exit status, never return into the parent
        status = 2
        try:
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            with open("/proc/self/statm") as statm:
                size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limit = size + TRIAL_MEMORY_BYTES
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            sampler = llama.llama_sampler_init_grammar(vocab, text.encode("utf-8"), b"root")
            if sampler:
                _trial_walk(vocab, sampler)
            status = 0 if sampler else 1
        finally:
            os._exit(status)
    deadline = time.monotonic() + TRIAL_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return (
                f"the grammar is too ambiguous: llama.cpp took over {TRIAL_SECONDS:.0f} s on its "
                f"first {TRIAL_STEPS} tokens in a trial (its parse states multiply with each "
                "token): refused"
            )
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name
        return f"llama.cpp crashed ({name}) on the grammar, in a trial process: refused"
    if os.WEXITSTATUS(status) in (0, 1):
        return None
    return "llama.cpp ran out of the trial's memory on the grammar: refused"


# A token's bytes that can stand in valid UTF-8 text: continuation bytes of a character the
# token before began, whole characters, then the start of one the next token ends. llama.cpp's
# grammar decodes bytes by their high bits alone, so it counts f6 a2 96 9d (no such character:
# no lead byte past f4) as one character of a string, and overlong forms and surrogates too.
_UTF8_FRAGMENT = re.compile(
    rb"[\x80-\xbf]{0,3}(?:[\x00-\x7f]|[\xc2-\xdf][\x80-\xbf]|\xe0[\xa0-\xbf][\x80-\xbf]"
    rb"|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]|\xf0[\x90-\xbf][\x80-\xbf]{2}"
    rb"|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})*"
    rb"(?:[\xc2-\xf4]|\xe0[\xa0-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]|\xed[\x80-\x9f]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]?|[\xf1-\xf3][\x80-\xbf]{1,2}|\xf4[\x80-\x8f][\x80-\xbf]?)?"
)
# The second byte a lead byte that ends a token allows (the rest: any continuation byte).
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_utf8_tables: dict[tuple[int, int, bytes], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _piece(vocab: llama.llama_vocab_p, token: int, buffer: ctypes.Array) -> bytes:
    n = llama.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, False)
    if n < 0:
        buffer = ctypes.create_string_buffer(-n)
        n = llama.llama_token_to_piece(vocab, token, buffer, len(buffer), 0, False)
    return buffer.raw[:n]


def utf8_tables(
    vocab: llama.llama_vocab_p, n_vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per token: whether its bytes can never be valid UTF-8, its first and last byte (-1: none)."""
    buffer = ctypes.create_string_buffer(64)
    probe = b"".join(_piece(vocab, t, buffer) for t in range(0, n_vocab, max(n_vocab // 16, 1)))
    key = (ctypes.cast(vocab, ctypes.c_void_p).value or 0, n_vocab, probe)
    if key not in _utf8_tables:
        pieces = [_piece(vocab, t, buffer) for t in range(n_vocab)]
        invalid = np.array([not _UTF8_FRAGMENT.fullmatch(p) for p in pieces], dtype=bool)
        first = np.array([p[0] if p else -1 for p in pieces], dtype=np.int16)
        last = np.array([p[-1] if p else -1 for p in pieces], dtype=np.int16)
        if len(_utf8_tables) > 8:
            _utf8_tables.clear()
        _utf8_tables[key] = (invalid, first, last)
    return _utf8_tables[key]


class GrammarGate:
    """A grammar sampler beside a sequence's sampler chain; sample() picks the next token.
    Beside the grammar, no token is let through whose bytes cannot continue the text as valid
    UTF-8 (llama.cpp's grammar lets some through: _UTF8_FRAGMENT)."""

    SHORTLIST = 512  # logits masked before the whole vocabulary (0: always the whole)

    def __init__(
        self, vocab: llama.llama_vocab_p, grammar: str, n_vocab: int, top_k: int | None = None
    ) -> None:
        """top_k: the tokens the chain keeps after the mask (1 when greedy), None when the
        chain may keep more or reorders logits (penalties): then no shortlist."""
        self._sampler = grammar_sampler(vocab, grammar)
        self._n_vocab = n_vocab
        self._top_k = top_k
        self._ids = np.arange(n_vocab, dtype=np.int32)
        # Candidates filled from the logits in numpy and handed to the samplers in place: no
        # Python loop over the vocabulary.
        self._candidates = np.zeros(n_vocab, dtype=TOKEN_DATA)
        self._array = llama.llama_token_data_array(
            data=self._candidates.ctypes.data_as(llama.llama_token_data_p)
        )
        self._invalid, self._first, self._last = utf8_tables(vocab, n_vocab)
        self._lead = -1  # the last byte of the text so far
        self.seconds = 0.0  # spent in the grammar: the single-token test, accepts, resampling
        self.resampled = 0  # tokens the plain chain chose and the grammar rejected

    def _logits(self, ctx: object, output: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama.llama_get_logits_ith(ctx, output), (self._n_vocab,))

    def _fill(self, ids: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The first len(ids) candidates, set to ids and logits: the array the samplers see."""
        candidates = self._candidates[: len(ids)]
        candidates["id"], candidates["logit"], candidates["p"] = ids, logits, 0.0
        array = self._array
        # llama-cpp-python annotates data as an array; its ctypes field is a pointer.
        array.data = candidates.ctypes.data_as(llama.llama_token_data_p)  # type: ignore[assignment]
        array.size, array.selected, array.sorted = len(ids), -1, False
        return candidates

    def _chosen(self) -> int:
        array = self._array
        return int(array.data[array.selected].id)

    def sample(
        self, chain: object, ctx: object, output: int, free: Callable[[int], bool] | None = None
    ) -> int:
        """The token chain picks from output's logits within the grammar; both accept it. A
        token free(token) lets through is the chain's alone: the grammar never sees it (the
        reasoning before an answer, cli/engine/reasoning.py's ReasoningWait)."""
        self._fill(self._ids, self._logits(ctx, output))
        llama.llama_sampler_apply(chain, ctypes.byref(self._array))
        token = self._chosen()
        if free is not None and free(token):
            llama.llama_sampler_accept(chain, token)
            return token
        started = time.perf_counter()
        one = self._fill(np.array([token]), np.ones(1))
        llama.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        refused = self._refused()
        if one["logit"][0] == -np.inf or refused[token]:
            self.resampled += 1
            shortlisted = self._shortlisted(chain, ctx, output, refused)
            if shortlisted is None:
                candidates = self._fill(self._ids, self._logits(ctx, output))
                llama.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
                candidates["logit"][refused] = -np.inf  # the ids are 0..n_vocab-1
                if not np.isfinite(candidates["logit"]).any():
                    # Accepting any token now would throw out of llama.cpp's C API: abort.
                    raise GrammarDeadEnd(
                        "the grammar reached a point that no token of the model can continue "
                        "(it needs a character the vocabulary cannot write): the reply ends "
                        "unfinished"
                    )
                llama.llama_sampler_apply(chain, ctypes.byref(self._array))
                token = self._chosen()
            else:
                token = shortlisted
        llama.llama_sampler_accept(self._sampler, token)
        self._lead = int(self._last[token]) if self._last[token] >= 0 else self._lead
        took = time.perf_counter() - started
        self.seconds += took
        if took > GRAMMAR_STEP_SECONDS:
            raise GrammarTooSlow(
                f"the grammar took {took:.1f} s on one token (at most {GRAMMAR_STEP_SECONDS:.0f} "
                "s): it is too ambiguous, and each token would take longer; the reply ends here"
            )
        llama.llama_sampler_accept(chain, token)
        return token

    def _refused(self) -> np.ndarray:
        """Per token: whether it cannot continue the text as valid UTF-8."""
        if self._lead not in _SECOND_BYTE:
            return self._invalid
        low, high = _SECOND_BYTE[self._lead]
        return self._invalid | (self._first < low) | (self._first > high)

    def _shortlisted(
        self, chain: object, ctx: object, output: int, refused: np.ndarray
    ) -> int | None:
        """The token sampled from the grammar-masked shortlist; None when under top_k pass."""
        size = min(self.SHORTLIST, self._n_vocab)
        if self._top_k is None or size <= self._top_k:
            return None
        logits = self._logits(ctx, output)
        top = np.argpartition(logits, self._n_vocab - size)[self._n_vocab - size :]
        candidates = self._fill(top, logits[top])
        llama.llama_sampler_apply(self._sampler, ctypes.byref(self._array))
        candidates["logit"][refused[candidates["id"]]] = -np.inf
        allowed = int(np.count_nonzero(candidates["logit"][: self._array.size] != -np.inf))
        if allowed < self._top_k:
            return None
        llama.llama_sampler_apply(chain, ctypes.byref(self._array))
        return self._chosen()

    def close(self) -> None:
        if self._sampler is not None:
            llama.llama_sampler_free(self._sampler)
            self._sampler = None

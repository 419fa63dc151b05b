"""llama-server's native POST /completion over quill's scheduler: a prompt as text, as token ids or
as both mixed, and the reply in llama-server's own shape (content, tokens, stop_type, timings,
generation_settings, completion_probabilities), whole or as one Server-Sent Event per token.

Where a field means what OpenAI's does (sampling, stop, n_probs, grammar, json_schema,
cache_prompt, ignore_eos), the body is translated into the /v1/completions body parse_request
reads, so its bounds, the context check and the constraints are that route's own; only what the
native API has of its own is read here: the prompt's shapes, n_predict's -1, seed's -1,
return_tokens, timings_per_token, id_slot and response_fields.

Several prompts in one request (a list of prompts) are a choice each (NativeCompletionApi.choices),
answered as a list. Not done as llama-server does: the samplers quill lacks (mirostat, DRY, XTC,
...: ignored, and generation_settings shows them off); id_slot (checked, but quill picks the slot
whose cache shares the longest prefix with the prompt).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cli.api.replies import progress_json, progress_timings, sse, timings
from cli.api.server import (
    MAX_CHOICES,
    ServedRequest,
    ServerLimits,
    bad_request,
    is_token_id,
    parse_request,
    shown_json,
    text_field,
    typed_field,
)
from cli.engine.events import Candidate, PromptProgress, StreamEvent, TokenLogprobs

if TYPE_CHECKING:
    from cli.engine.engine import Engine

# The fields whose meaning is OpenAI's (or llama-server's extension of /v1/completions too):
# passed on to parse_request as sent.
SHARED_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "n_probs", "cache_prompt", "stream", "ignore_eos",
    "grammar", "json_schema", "logit_bias", "return_progress", "post_sampling_probs",
)  # fmt: skip
# llama-server's samplers that quill does not have, at the values that turn them off: what a
# request ran with, whatever it asked of them.
SAMPLERS_OFF = {
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0,
    "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0,
    "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64, "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0, "adaptive_decay": 0.9,
    "min_keep": 0, "n_keep": 0, "n_discard": 0,
}  # fmt: skip
STOP_TYPES = {"length": "limit", "stop": "eos"}  # "word" where a stop string matched
LOWEST_LOGPROB = -3.4028234663852886e38  # llama-server's stand-in for log(0), which JSON lacks
PROMPT_SHAPES = (
    "'prompt' must be a string, an array of token ids and strings, or an object with a "
    "prompt_string"
)


@dataclass
class NativeRequest(ServedRequest):
    """A request for the scheduler with what its llama-server reply reports."""

    prompt_text: str = ""  # the prompt's tokens as text, special tokens spelled out
    n_predict: int = 0  # as generation_settings reports it (-1: until the context is full)
    id_slot: int = -1


class NativeCompletionApi:
    """POST /completion: llama-server's own completion API."""

    def parse(self, body: dict, engine: Engine, limits: ServerLimits) -> NativeRequest:
        tokens = prompt_tokens(body.get("prompt"), engine)
        asked = _n_predict(body, limits)
        max_tokens = limits.max_tokens if asked == -1 else asked
        served = parse_request(_openai_body(body, max_tokens), engine, limits, False, tokens)
        if body.get("seed") == -1:  # llama-server's "a random seed", whatever the server's --seed
            served.sampling = dataclasses.replace(served.sampling, seed=None)
        for name in ("return_tokens", "timings_per_token"):
            typed_field(body, name, bool, False)  # read when replying: checked before queueing
        _response_fields(body)
        return NativeRequest(
            **{f.name: getattr(served, f.name) for f in dataclasses.fields(served)},
            prompt_text=b"".join(engine.piece(t, True) for t in tokens).decode("utf-8", "replace"),
            n_predict=-1 if asked == -1 else served.max_tokens,
            id_slot=_id_slot(body, engine),
        )

    def reply_format(self, body: dict, served: ServedRequest, model_name: str) -> NativeReply:
        assert isinstance(served, NativeRequest)  # made by parse above
        return NativeReply(body, served, model_name)

    def choices(self, body: dict) -> list[dict]:
        """A body per prompt where 'prompt' is a list of several (each a string, token ids or
        a prompt object), generated side by side; else the body."""
        prompts = several_prompts(body.get("prompt"))
        if prompts is None:
            return [body]
        if len(prompts) > MAX_CHOICES:
            raise bad_request(
                f"'prompt' holds {len(prompts)} prompts: at most {MAX_CHOICES} per request (each "
                "takes a slot); send the rest in another request",
                "prompt",
            )
        return [{**body, "prompt": prompt} for prompt in prompts]

    def merged(self, body: dict, wholes: list[dict[str, Any]]) -> Any:
        """Several prompts' replies as a list, in the prompts' order, as llama-server's."""
        return wholes if several_prompts(body.get("prompt")) is not None else wholes[0]


# --- the request ----------------------------------------------------------------------------------


def several_prompts(prompt: Any) -> list | None:
    """The prompts of a 'prompt' that is a list of two or more (a list with no token id in it
    is a list of prompts, as llama-server reads one); None: one prompt."""
    if isinstance(prompt, list) and len(prompt) > 1 and not any(map(_is_number, prompt)):
        return prompt
    return None


def prompt_tokens(prompt: Any, engine: Engine) -> list[int]:
    """The tokens of a prompt as llama-server reads one: a string (tokenized with the BOS the
    model declares, special tokens parsed), an array of token ids and strings (concatenated; the
    BOS only where the first is a string), or {"prompt_string": either}."""
    while isinstance(prompt, list) and len(prompt) == 1 and not _is_number(prompt[0]):
        prompt = prompt[0]  # llama-server: a list of one prompt is that prompt
    if isinstance(prompt, dict):
        prompt = _prompt_object(prompt)
    if isinstance(prompt, str):
        tokens = engine.tokenize(text_field(prompt, "'prompt'", "prompt"))
    elif isinstance(prompt, list) and any(_is_number(item) for item in prompt):
        tokens = _mixed_tokens(prompt, engine)
    elif isinstance(prompt, list) and prompt:  # a list of prompts inside one prompt
        raise bad_request(f"prompt lists do not nest: {PROMPT_SHAPES}", "prompt")
    else:
        raise bad_request(f"{PROMPT_SHAPES}, got {shown_json(prompt)}", "prompt")
    if not tokens:
        raise bad_request("the prompt has no tokens", "prompt")
    return tokens


def _prompt_object(prompt: dict) -> Any:
    if "multimodal_data" in prompt:
        raise bad_request("'prompt' has multimodal_data: quill's models read text only", "prompt")
    if "prompt_string" not in prompt:
        raise bad_request(f"{PROMPT_SHAPES}, got {shown_json(prompt)}", "prompt")
    return prompt["prompt_string"]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _mixed_tokens(prompt: list, engine: Engine) -> list[int]:
    size = engine.vocabulary.n_vocab
    tokens: list[int] = []
    for index, item in enumerate(prompt):
        if isinstance(item, str):
            text = text_field(item, f"prompt[{index}]", "prompt")
            if index == 0:
                tokens += engine.tokenize(text)
            else:
                tokens += engine.vocabulary.tokenize_bytes(text.encode("utf-8"), False)
        elif is_token_id(item, size):
            tokens.append(item)
        else:
            raise bad_request(
                f"prompt[{index}] is neither a string nor a token id of this model (0 to "
                f"{size - 1}): got {shown_json(item)}",
                "prompt",
            )
    return tokens


def _n_predict(body: dict, limits: ServerLimits) -> int | None:
    """The most tokens to generate: n_predict (or max_tokens), -1 for as many as the server lets
    a request have (the context's end bounds it further), more than that cut to it (as
    llama-server cuts a request's to its --n-predict); None: the server's default."""
    name = "n_predict" if body.get("n_predict") is not None else "max_tokens"
    asked = typed_field(body, name, int, None)
    if asked is None or asked == -1:
        return asked
    if asked < 1:
        raise bad_request(
            f"'{name}' must be -1 (until the context is full) or at least 1, got {asked}: quill "
            "generates at least one token",
            name,
        )
    return min(asked, limits.max_tokens)


def _openai_body(body: dict, max_tokens: int | None) -> dict[str, Any]:
    """The /v1/completions body for parse_request: the shared fields as sent, with llama-server's
    values that OpenAI's ranges lack read its way (a negative temperature samples greedily, a
    top_k of 0 or less is off, seed -1 is random)."""
    shared = {name: body[name] for name in SHARED_FIELDS if body.get(name) is not None}
    if _is_number(shared.get("temperature")) and shared["temperature"] < 0:
        shared["temperature"] = 0.0
    if _is_number(shared.get("top_k")) and shared["top_k"] < 0:
        shared["top_k"] = 0
    if shared.get("seed") == -1:
        del shared["seed"]
    if max_tokens is not None:
        shared["max_tokens"] = max_tokens
    return shared


def _id_slot(body: dict, engine: Engine) -> int:
    slot = typed_field(body, "id_slot", int, -1)
    if not -1 <= slot < engine.parallel:
        raise bad_request(
            f"'id_slot' must be -1 (any) or a slot from 0 to {engine.parallel - 1}, got {slot}",
            "id_slot",
        )
    return slot


def _response_fields(body: dict) -> list[str]:
    fields = body.get("response_fields") or []
    if not isinstance(fields, list) or not all(isinstance(f, str) for f in fields):
        raise bad_request("'response_fields' must be an array of strings", "response_fields")
    return fields


# --- the reply ------------------------------------------------------------------------------------


class NativeReply:
    """One reply in llama-server's shape: whole, or a frame per token (content, that token, its
    probabilities, timings where asked) and a last frame with stop true and the whole reply's
    other fields (its content and tokens were sent already, as llama-server's last frame says)."""

    def __init__(self, body: dict, served: NativeRequest, model_name: str) -> None:
        self.served = served
        self.model_name = model_name
        self.return_tokens = typed_field(body, "return_tokens", bool, False)
        self.timings_per_token = typed_field(body, "timings_per_token", bool, False)
        self.stream = bool(body.get("stream"))
        self.response_fields = _response_fields(body)
        self.has_new_line = False  # the stream's text so far holds one

    def whole(self, events: list[StreamEvent], queued_s: float) -> dict[str, Any]:
        content = "".join(event.text for event in events)
        tokens = [event.token for event in events if event.token is not None]
        reply = self._final(events[-1], content, tokens if self.return_tokens else [])
        entries = [entry for event in events for entry in event.logprobs or ()]
        if self.served.logprobs:
            reply["completion_probabilities"] = [_probability(entry) for entry in entries]
        return self._selected(reply)

    def opening(self) -> list[bytes]:
        return []

    def frames(self, event: StreamEvent, queued_s: float) -> list[bytes]:
        """The token's frame; the last token's also the closing one (no [DONE]: llama-server's
        native stream ends without one)."""
        self.has_new_line = self.has_new_line or "\n" in event.text
        last = event.finish_reason is not None
        frame: dict[str, Any] = {
            "index": self.served.choice,
            "content": event.text,
            "tokens": [event.token] if event.token is not None else [],
            "stop": False,
            "id_slot": self.served.id_slot,
            "tokens_predicted": event.generation_tokens,
            "tokens_evaluated": event.prompt_tokens,
        }
        if event.logprobs:
            frame["completion_probabilities"] = [_probability(entry) for entry in event.logprobs]
        if last or self.timings_per_token:
            frame["timings"] = timings(event)
        if not last:
            return [sse(frame)]
        return [sse(frame), sse(self._selected(self._final(event, "", [])))]

    def failure(self, error: dict[str, Any]) -> bytes:
        return sse(error)

    def progress(self, progress: PromptProgress) -> list[bytes]:
        """A frame with no content and the prompt's progress (its timings where asked)."""
        frame: dict[str, Any] = {
            "index": self.served.choice,
            "content": "",
            "tokens": [],
            "stop": False,
            "id_slot": self.served.id_slot,
            "tokens_predicted": 0,
            "tokens_evaluated": progress.total,
            "prompt_progress": progress_json(progress),
        }
        if self.timings_per_token:
            frame["timings"] = progress_timings(progress)
        return [sse(frame)]

    def _final(self, last: StreamEvent, content: str, tokens: list[int]) -> dict[str, Any]:
        has_new_line = self.has_new_line or "\n" in content
        return {
            "index": self.served.choice,
            "content": content,
            "tokens": tokens,
            "id_slot": self.served.id_slot,
            "stop": True,
            "model": self.model_name,
            "tokens_predicted": last.generation_tokens,
            "tokens_evaluated": last.prompt_tokens,
            "generation_settings": self._settings(last),
            "prompt": self.served.prompt_text,
            "has_new_line": has_new_line,
            "truncated": False,  # quill shifts no context: a full one ends the reply (limit)
            "stop_type": _stop_type(last),
            "stopping_word": last.stop_string or "",
            "tokens_cached": last.cached_prompt_tokens,
            "timings": timings(last),
        }

    def _settings(self, last: StreamEvent) -> dict[str, Any]:
        """What this request ran with (its seed: the one its sequence drew, where random)."""
        served, sampling = self.served, self.served.sampling
        return {
            "seed": last.seed,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "repeat_last_n": sampling.repeat_last_n,
            "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            **SAMPLERS_OFF,
            "stop": list(served.stop),
            "max_tokens": served.n_predict,
            "n_predict": served.n_predict,
            "ignore_eos": sampling.ignore_eos,
            "stream": self.stream,
            "n_probs": served.logprobs or 0,
            "grammar": sampling.grammar or "",
            "cache_prompt": served.cache_prompt,
            "timings_per_token": self.timings_per_token,
            "post_sampling_probs": served.post_sampling,
            "return_tokens": self.return_tokens,
        }

    def _selected(self, reply: dict[str, Any]) -> dict[str, Any]:
        """The fields response_fields names ("a/b": b of a, under the key "a/b"), or all."""
        if not self.response_fields:
            return reply
        selected = {}
        for path in self.response_fields:
            value: Any = reply
            for key in path.split("/"):
                if not isinstance(value, dict) or key not in value:
                    break
                value = value[key]
            else:
                selected[path] = value
        return selected


def _stop_type(last: StreamEvent) -> str:
    if last.stop_string is not None:
        return "word"
    return STOP_TYPES[last.finish_reason or "stop"]


def _probability(entry: TokenLogprobs) -> dict[str, Any]:
    """One token of completion_probabilities, as llama-server writes it: logprobs, or with
    post_sampling_probs the probabilities themselves."""
    top = "top_probs" if entry.post_sampling else "top_logprobs"
    return {
        **_candidate(entry.chosen, entry.post_sampling),
        top: [_candidate(c, entry.post_sampling) for c in entry.top],
    }


def _candidate(candidate: Candidate, as_probability: bool) -> dict[str, Any]:
    said = {"id": candidate.token, "token": candidate.text, "bytes": list(candidate.piece)}
    if as_probability:
        return {**said, "prob": math.exp(candidate.logprob)}
    logprob = candidate.logprob if math.isfinite(candidate.logprob) else LOWEST_LOGPROB
    return {**said, "logprob": logprob}

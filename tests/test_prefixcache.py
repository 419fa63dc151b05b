"""The server's prefix cache: a slot keeps its tokens and KV cells after a request; a follow-up
goes to the slot holding its prefix and prefills only the rest; its reply and a full prefill's are
both this machine's greedy reply, up to near-ties (tests/neartie.py: a prefix computed while an
earlier reply decoded, one token per batch, and the same prefix prefilled in one batch go through
different kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.engine.batching import BatchRequest, BatchScheduler
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

from neartie import assert_near, assert_near_tokens, token_mismatch
from reference import Reference

GREEDY = SamplingParams(temperature=0)


def conversation(engine: Engine, turns: list[tuple[str, str]]) -> list[int]:
    return engine.tokenize(engine.conversation_text(turns)[0])


def reply(scheduler: BatchScheduler, tokens: list[int], cache: bool = True, n: int = 12):
    request = scheduler.submit(BatchRequest(tokens, n, GREEDY, cache_prompt=cache))
    events = list(request.stream())
    return request, [e.token for e in events], "".join(e.text for e in events), events[-1]


def follow_up_matches_full_prefill(path: Path, options: LoadOptions) -> None:
    with Engine(path, options) as engine:
        scheduler = BatchScheduler(engine)
        try:
            first = [("user", "Name three rivers in Europe and say where each one flows.")]
            prompt = conversation(engine, first)
            request, _, text, _ = reply(scheduler, prompt)
            assert request.cached_tokens == 0  # nothing was cached yet
            second = conversation(engine, [*first, ("assistant", text), ("user", "And in Asia?")])
            reused, reused_tokens, reused_text, last = reply(scheduler, second)
            # The whole first prompt was in the slot; the template may re-render the reply's end.
            assert reused.cached_tokens >= len(prompt)
            assert last.cached_prompt_tokens == reused.cached_tokens
            assert last.prompt_tokens == len(second)
            full, full_tokens, full_text, full_last = reply(scheduler, second, cache=False)
            assert full.cached_tokens == 0 and full_last.cached_prompt_tokens == 0
        finally:
            scheduler.close()
    reference = Reference(path, n_ctx=512, threads=1, kv_type=options.kv_type_k)
    try:
        assert_near_tokens(reference, second, reused_tokens, full_tokens)
        # The texts streamed are the pieces of the tokens.
        assert_near(reference, second, reused_text, full_text)
    finally:
        reference.close()


def test_a_follow_up_on_smollm2_prefills_only_what_is_new(smollm2_path):
    follow_up_matches_full_prefill(smollm2_path, LoadOptions(n_ctx=512, parallel=2))


def test_a_follow_up_on_the_tiny_model_with_a_q8_0_cache(tiny32_path):
    options = LoadOptions(n_ctx=512, parallel=2, kv_type_k="q8_0", kv_type_v="q8_0")
    follow_up_matches_full_prefill(tiny32_path, options)


def test_a_follow_up_with_a_q8_0_cache_on_smollm2(smollm2_path):
    options = LoadOptions(n_ctx=512, parallel=2, kv_type_k="q8_0", kv_type_v="q8_0")
    follow_up_matches_full_prefill(smollm2_path, options)


def test_requests_go_to_the_slot_holding_their_prefix(smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=256, parallel=2)) as engine:
        scheduler = BatchScheduler(engine)
        try:
            a = engine.tokenize("The history of the Roman empire begins with")
            b = engine.tokenize("def quicksort(items):\n    if len(items) <= 1:")
            reply(scheduler, a, n=4)
            reply(scheduler, b, n=4)
            a_slot, b_slot = engine.cached(0), engine.cached(1)
            assert a_slot[: len(a)] == a and b_slot[: len(b)] == b
            # B was served last: its follow-up still finds B's slot, and A's then finds A's.
            b_again, *_ = reply(scheduler, b_slot + engine.tokenize(" return items"), n=4)
            a_again, *_ = reply(scheduler, a_slot + engine.tokenize(" a story"), n=4)
            assert b_again.cached_tokens == len(b_slot)
            assert a_again.cached_tokens == len(a_slot)
            assert engine.cached(0)[: len(a_slot)] == a_slot
            # A miss takes the least recently used slot (B's), keeping A's conversation.
            bonjour = engine.tokenize("Bonjour")
            miss, *_ = reply(scheduler, bonjour, n=2)
            assert miss.cached_tokens == 0
            assert engine.cached(0)[: len(a_slot)] == a_slot
            assert engine.cached(1)[: len(bonjour)] == bonjour
            assert scheduler.reused_tokens == len(a_slot) + len(b_slot)
        finally:
            scheduler.close()


def test_an_identical_prompt_still_decodes_its_last_token(smollm2_path):
    """With every prompt token cached, the last is decoded again: its logits are needed."""
    with Engine(smollm2_path, LoadOptions(n_ctx=256, parallel=1)) as engine:
        scheduler = BatchScheduler(engine)
        try:
            prompt = engine.tokenize("Write one word about the sea:")
            _, first, _, _ = reply(scheduler, prompt, n=6)
            again, second, _, last = reply(scheduler, prompt, n=6)
        finally:
            scheduler.close()
    assert again.cached_tokens == len(prompt) - 1 == last.cached_prompt_tokens
    reference = Reference(smollm2_path, n_ctx=256, threads=1)
    try:
        assert_near_tokens(reference, prompt, first, second)
    finally:
        reference.close()


@pytest.mark.parametrize("parallel", [1, 3])
def test_keep_prefix_frees_only_the_cells_past_it(smollm2_path, parallel):
    with Engine(smollm2_path, LoadOptions(n_ctx=128, parallel=parallel)) as engine:
        tokens = engine.tokenize("one two three four five six")
        seq = parallel - 1
        engine.decode([(seq, t, False) for t in tokens])
        engine.keep_prefix(seq, 3)
        assert engine.cached(seq) == tokens[:3]
        engine.keep_prefix(seq, 10)  # past the end: nothing to free
        assert engine.cached(seq) == tokens[:3]
        with pytest.raises(ValueError):
            engine.keep_prefix(seq, -1)
        # The next token goes to position 3: decoding the rest again gives the same logits.
        outputs = engine.decode([(seq, t, i == len(tokens) - 4) for i, t in enumerate(tokens[3:])])
        kept = engine.output_logits(outputs[-1])
        engine.forget(seq)
        outputs = engine.decode([(seq, t, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        fresh = engine.output_logits(outputs[-1])
    assert int(kept.argmax()) == int(fresh.argmax())
    assert float(abs(kept - fresh).max()) < 1e-2


def test_the_server_reports_reuse_through_the_openai_client(smollm2_path, quill_home, tmp_path):
    import openai

    from conftest import start_server

    process, url = start_server(quill_home, tmp_path, "--parallel", "2", "--ctx", "512")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        history = [{"role": "user", "content": "Give me two tips for writing tests."}]
        first = client.chat.completions.create(
            model="quill", messages=history, max_tokens=16, temperature=0
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "One more, please."},
        ]

        def streamed(**extra) -> tuple[str, object]:
            stream = client.chat.completions.create(
                model="quill", messages=history, max_tokens=16, temperature=0, stream=True,
                stream_options={"include_usage": True}, **extra,
            )  # fmt: skip
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return text, chunks[-1]

        reused_text, reused = streamed()
        full_text, full = streamed(extra_body={"cache_prompt": False})
    finally:
        process.terminate()
        log = process.communicate(timeout=30)[1]
    cached = reused.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert reused.timings["cache_n"] == cached  # llama-server's name, in quill's timings
    assert reused.timings["prompt_n"] == reused.usage.prompt_tokens - cached
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    reference = Reference(smollm2_path, n_ctx=512, threads=1)
    try:
        turns = [(m["role"], m["content"]) for m in history]
        prompt = reference.tokenize(reference.chat(turns), add_special=True)
        assert reused.usage.prompt_tokens == len(prompt)
        assert_near(reference, prompt, reused_text, full_text)
    finally:
        reference.close()
    assert f"{cached} cached" in log


def test_the_near_tie_check_refuses_a_clear_difference(smollm2_path):
    with Engine(smollm2_path, LoadOptions(n_ctx=256)) as engine:
        prompt = engine.tokenize("The capital of France is")
        full = [e.token for e in engine.stream_generate(prompt, 3, GREEDY)]
        wrong = [engine.tokenize(" zebra")[0], *full[1:]]
    reference = Reference(smollm2_path, n_ctx=256, threads=1)
    try:
        assert token_mismatch(reference, prompt, full) is None
        problem = token_mismatch(reference, prompt, wrong)
        assert problem is not None and "this machine picks" in problem
    finally:
        reference.close()


@pytest.mark.parametrize("budget", [64 << 20, 0])
def test_a_parked_cache_comes_back_for_its_conversation(smollm2_path, budget):
    """One slot, two conversations taking turns: with a RAM budget, the one that lost the slot
    is parked and loaded back for its next turn; without, its turn prefills it all again."""
    with Engine(smollm2_path, LoadOptions(n_ctx=512, parallel=1)) as engine:
        scheduler = BatchScheduler(engine, park_bytes=budget)
        try:
            a_turns = [
                ("system", "You answer questions about geography. " * 8),
                ("user", "Name three rivers in Europe and say where each one flows."),
            ]
            b_turns = [("system", "You write short poems. " * 8),
                       ("user", "Write four lines about snow on a quiet town.")]  # fmt: skip
            a = conversation(engine, a_turns)
            _, _, a_text, _ = reply(scheduler, a, n=40)
            reply(scheduler, conversation(engine, b_turns), n=40)
            follow = conversation(engine, [*a_turns, ("assistant", a_text),
                                           ("user", "And in Asia?")])  # fmt: skip
            back, back_tokens, _, _ = reply(scheduler, follow)
            parked = scheduler.parked_bytes
            full, full_tokens, _, _ = reply(scheduler, follow, cache=False)
        finally:
            scheduler.close()
    reference = Reference(smollm2_path, n_ctx=512, threads=1)
    try:
        assert_near_tokens(reference, follow, back_tokens, full_tokens)
    finally:
        reference.close()
    assert full.cached_tokens == 0
    if budget:
        assert back.cached_tokens >= len(a)  # A's prompt (and reply) came back from RAM
        assert 0 < parked <= budget  # B's cache is parked now, in its place
    else:
        assert back.cached_tokens < len(a) // 2  # only what every chat shares (the template)
        assert parked == 0


def test_serve_cache_ram_parks_a_conversation_that_loses_its_slot(
    smollm2_path, quill_home, tmp_path
):
    import httpx2 as httpx

    from conftest import start_server

    process, url = start_server(
        quill_home, tmp_path, "--parallel", "1", "--ctx", "512", "--cache-ram", "64MiB"
    )

    def ask(messages: list[dict]) -> dict:
        body = {"messages": messages, "max_tokens": 40, "temperature": 0}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    try:
        a = [{"role": "system", "content": "You answer questions about geography. " * 8},
             {"role": "user", "content": "Name three rivers in Europe."}]  # fmt: skip
        first = ask(a)
        ask([{"role": "system", "content": "You write short poems. " * 8},
             {"role": "user", "content": "Four lines about snow."}])  # fmt: skip
        a += [first["choices"][0]["message"], {"role": "user", "content": "And in Asia?"}]
        back = ask(a)
    finally:
        process.terminate()
        log = process.communicate(timeout=30)[1]
    assert "parked caches up to 64.0 MiB" in log.splitlines()[0]
    assert (
        back["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
    )


def test_serve_refuses_a_cache_ram_that_is_not_a_size(quill_home, tmp_path):
    from conftest import run_quill

    result = run_quill(quill_home, "serve", "--cache-ram", "plenty", "--port", "0", timeout=60)
    assert result.returncode == 2 and "--cache-ram: not a size" in result.stderr

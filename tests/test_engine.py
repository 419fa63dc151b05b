"""The engine against the real SmolLM2-135M and an independent low-level decoder."""

from __future__ import annotations

import re

import pytest

from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
from cli.engine.sampling import SamplingParams

import threadcount
from neartie import assert_near_tokens
from reference import Reference

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    with Engine(smollm2_path, LoadOptions(threads=2)) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def reference(smollm2_path):
    ref = Reference(smollm2_path)
    yield ref
    ref.close()


def generate(engine, tokens, max_tokens, sampling=GREEDY, stop=()):
    return list(engine.stream_generate(tokens, max_tokens, sampling, stop))


def test_greedy_tokens_match_the_independent_decoder(engine, reference):
    prompt = reference.chat([("user", "Name three primary colors.")])
    assert engine.chat_prompt([("user", "Name three primary colors.")]) == prompt
    tokens = reference.tokenize(prompt, add_special=True)
    assert engine.tokenize(prompt) == tokens  # same path: a tokenizer, no decoding
    events = generate(engine, tokens, 48)
    assert_near_tokens(reference, tokens, [e.token for e in events])
    # same path: the text streamed is the pieces of the reply's own tokens
    assert "".join(e.text for e in events) == reference.text([e.token for e in events])


def test_unicode_streams_byte_exactly(engine, reference):
    # Plain ChatML without SmolLM2's default system prompt, with which the model (greedy) does
    # repeat the characters this test needs.
    prompt = "<|im_start|>user\nRepeat exactly: 你好,世界 🌍🚀<|im_end|>\n<|im_start|>assistant\n"
    tokens = engine.tokenize(prompt)
    events = generate(engine, tokens, 40)
    assert_near_tokens(reference, tokens, [e.token for e in events])
    full = reference.text([e.token for e in events])
    assert re.search(r"[\u4e00-\u9fff]", full) and re.search(r"[\U0001F300-\U0001FAFF]", full)
    chunks = [e.text for e in events]
    assert "".join(chunks) == full  # same path: the pieces of the tokens streamed
    assert all("\ufffd" not in chunk for chunk in chunks)
    # Some characters really did arrive split over several tokens.
    assert len([e for e in events if e.text == ""]) > 0


def test_token_pieces_longer_than_32_bytes_are_kept_whole(engine, reference):
    long_tokens = [t for t in range(reference.n_vocab) if len(reference.piece(t)) > 32]
    assert long_tokens, "SmolLM2's vocabulary has pieces over 32 bytes"
    for token in long_tokens:
        assert engine.piece(token) == reference.piece(token)  # same path: the vocabulary


def test_finish_reasons(engine):
    tokens = engine.tokenize(engine.chat_prompt([("user", "Say hi.")]))
    events = generate(engine, tokens, 200)
    assert events[-1].finish_reason == "stop" and events[-1].stop_string is None
    assert engine.is_end_of_generation(events[-1].token)
    assert all(e.finish_reason is None for e in events[:-1])
    short = generate(engine, tokens, 3)
    assert short[-1].finish_reason == "length" and short[-1].generation_tokens == 3


def test_stop_string_spanning_two_tokens(engine, reference):
    prompt = reference.chat([("user", "Write two short sentences about the sea.")])
    tokens = engine.tokenize(prompt)
    unstopped = generate(engine, tokens, 60)
    assert_near_tokens(reference, tokens, [e.token for e in unstopped])
    pieces = [e.text for e in unstopped]
    # A stop string made of the end of one token and the start of the next, found in the output.
    index = next(
        i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
    )
    stop = pieces[index][-2:] + pieces[index + 1][:2]
    before = "".join(pieces)
    cut = before.index(stop)
    events = generate(engine, tokens, 60, stop=(stop, "a stop string that never appears"))
    text = "".join(e.text for e in events)
    assert text == before[:cut]  # same path: the engine's own reply, cut by the stop string
    assert events[-1].finish_reason == "stop" and events[-1].stop_string == stop
    assert stop not in text


def test_prefill_time_agrees_with_llama_perf_counter(engine):
    text = " ".join(f"item {i} is a word in a long list of things to remember." for i in range(40))
    tokens = engine.tokenize(text)
    assert len(tokens) > 400
    engine.clear_cache()  # a cold prompt, no prefix reuse
    events = generate(engine, tokens, 8)
    perf = engine.perf()
    assert perf["n_p_eval"] == len(tokens)
    engine_ms = events[-1].prefill_s * 1000
    assert engine_ms == pytest.approx(perf["t_p_eval_ms"], rel=0.10)
    assert perf["n_eval"] == events[-1].generation_tokens - 1  # the first token needs no decode


@pytest.mark.parametrize("n_batch", [512, 1])
def test_the_load_warm_up_leaves_no_trace(smollm2_path, n_batch):
    # The engine decodes BOS and EOS once at load (as llama.cpp's tools do): those cells and
    # counters must be gone before the first prompt, or its positions and numbers would be off.
    # A batch of 1 (quill bench -b 1) takes one of them: two would abort llama.cpp.
    import llama_cpp as llama

    with Engine(smollm2_path, LoadOptions(threads=2, n_batch=n_batch)) as fresh:
        assert llama.llama_memory_seq_pos_max(llama.llama_get_memory(fresh._ctx), 0) == -1
        assert fresh.perf()["t_p_eval_ms"] == 0 and fresh.perf()["t_eval_ms"] == 0
        assert fresh.cached_tokens == 0


@threadcount.needs_proc
def test_the_load_warm_up_leaves_no_compute_threads_behind(tiny_path):
    # OpenMP gives every thread that computes a team of worker threads. A warm-up left a team on
    # the loading thread, quill serve's scheduler thread then made a second, and with more
    # workers than cores every barrier slept: 40,000 context switches a thread in a 16-request
    # load, 6% of its throughput. In a fresh process: the threads after the load are the ones
    # before it (the warm-up's thread has ended and taken its team with it).
    script = f"""
from pathlib import Path
import llama_cpp
from threadcount import settle, threads
from cli.engine.engine import Engine
from cli.engine.options import LoadOptions
llama_cpp.llama_backend_init()
before = threads()
with Engine(Path({str(tiny_path)!r}), LoadOptions(threads=2)):
    print(before, settle(before))
"""
    [(before, after)] = threadcount.run(script)
    assert after == before


def test_prompt_longer_than_a_batch_is_prefilled_in_chunks(smollm2_path, reference):
    text = " ".join(f"line {i}" for i in range(60))
    with Engine(smollm2_path, LoadOptions(threads=2, n_batch=32)) as small_batches:
        tokens = small_batches.tokenize(text)
        assert len(tokens) > 100 and len(tokens) % 32 > 1
        events = generate(small_batches, tokens, 4)
        assert small_batches.perf()["n_p_eval"] == len(tokens)
    assert events[-1].generation_tokens == 4
    # Prefilled in chunks of 32, the reply is the one-batch reference's, up to near-ties.
    assert_near_tokens(reference, tokens, [e.token for e in events])


def test_a_second_prompt_reuses_the_shared_prefix(engine):
    first = engine.tokenize(engine.chat_prompt([("user", "What is a cat?")]))
    generate(engine, first, 4)
    second = engine.tokenize(engine.chat_prompt([("user", "What is a cat? And a dog?")]))
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    events = generate(engine, second, 4)
    assert events[-1].cached_prompt_tokens == shared
    assert engine.perf()["n_p_eval"] == len(second) - shared


def test_same_seed_same_sample(engine):
    tokens = engine.tokenize(engine.chat_prompt([("user", "Tell me a story.")]))
    sampling = SamplingParams(temperature=1.0, seed=1234)
    first = [e.token for e in generate(engine, tokens, 20, sampling)]
    again = [e.token for e in generate(engine, tokens, 20, sampling)]
    assert first == again
    assert generate(engine, tokens, 1, sampling)[-1].seed == 1234


@pytest.mark.parametrize("n_ctx", [512, 4096])
def test_kv_cache_size_matches_llama_cpp_allocation(smollm2_path, capsys, n_ctx):
    with Engine(smollm2_path, LoadOptions(n_ctx=n_ctx, threads=2), verbose=True) as verbose:
        computed = verbose.kv_cache_bytes
    logged = re.search(r"llama_kv_cache: size =\s+([\d.]+) MiB", capsys.readouterr().err)
    assert logged, "llama.cpp logs its KV allocation at load"
    assert computed / 2**20 == pytest.approx(float(logged.group(1)), abs=0.005)


def test_ignore_eos_generates_past_the_end(engine):
    tokens = engine.tokenize(engine.chat_prompt([("user", "Say hi.")]))
    natural = generate(engine, tokens, 200)
    assert natural[-1].finish_reason == "stop"
    forced = generate(
        engine, tokens, len(natural) + 10, SamplingParams(temperature=0, ignore_eos=True)
    )
    assert forced[-1].finish_reason == "length"
    assert not any(t in engine.eog_tokens for t in (e.token for e in forced))
    # same path: one engine, the same batches; only the end token is banned from the choice
    assert [e.token for e in forced[: len(natural) - 1]] == [e.token for e in natural[:-1]]

"""Errors from the engine, store and api carry facts; the commands alone name the options that
change them (cli/commands/wording.py), in the lines the docs show."""

from __future__ import annotations

import pytest

from cli.app import app
from cli.commands.wording import user_message
from cli.errors import ContextOverflowError, EndpointError, KvCacheTypeError, QueueFullError


def test_context_overflow_carries_facts_and_the_command_names_the_options():
    error = ContextOverflowError(110, 200, 256, 8192)
    assert "--" not in str(error) and (error.prompt_tokens, error.max_tokens) == (110, 200)
    assert user_message(error) == (  # docs/run.md's example
        "prompt is 110 tokens and --max-tokens is 200, 310 in all, but the context window is 256 "
        "tokens: raise --ctx (up to 8192, the model's trained context), shorten the input, or "
        "lower --max-tokens"
    )
    longest = user_message(ContextOverflowError(110, 200, 256, 256))
    assert "the model cannot take a longer --ctx" in longest


def test_a_kv_type_the_heads_cannot_hold_is_refused_with_the_option(runner, tiny_path):
    """The tiny model's heads have 16 values: a quantized cache's blocks of 32 cannot split them."""
    result = runner.invoke(app, ["run", "-m", str(tiny_path), "--kv-type", "q8_0", "-n", "1", "hi"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "quill: error: a q8_0 K cache stores blocks of 32 values, but this model's heads have 16: "
        "use --kv-type f16 for it"
    ]
    assert "--" not in str(KvCacheTypeError("q8_0", "K", 16))


def test_the_servers_full_queue_is_not_a_client_error():
    assert not issubclass(QueueFullError, EndpointError)
    assert QueueFullError(3).waiting == 3


def test_a_chat_that_is_not_found_is_said_by_the_store_and_worded_by_chat(tmp_path):
    from cli.errors import ChatNotFoundError
    from cli.store.chats import find_transcript

    for name in ("chat-1", "chat-2"):
        (tmp_path / f"{name}.json").write_text("{}", "utf-8")
    assert find_transcript("chat-1", tmp_path) == tmp_path / "chat-1.json"
    lines = []
    for name, folder in (("last", tmp_path / "none"), ("nope", tmp_path), ("chat", tmp_path)):
        try:
            find_transcript(name, folder)
        except ChatNotFoundError as error:
            assert "--" not in str(error)
            lines.append(user_message(error))
    assert lines == [
        f"no saved chats in {tmp_path / 'none'} to resume",
        f"no saved chat 'nope' in {tmp_path}: --resume last, or an ID from there",
        "--resume 'chat' matches 2 chats (chat-1, chat-2); give more of it",
    ]


def test_template_notes_name_no_option_and_the_commands_add_it():
    from cli.commands.wording import note_words
    from cli.engine.templates import choose_template, template_notes

    template, fallback = choose_template(None, None, "chatml")
    assert template is not None and fallback is not None and "--" not in fallback
    assert note_words(fallback) == (
        "the model file has no chat template; using the chatml template its models.yaml entry "
        "names (--chat-template FILE sets another)"
    )
    (switch,) = template_notes(template, think=False)
    assert "--" not in switch
    assert note_words(switch) == (
        "the chat template has no thinking switch: --think/--no-think changes nothing"
    )


def test_a_load_failure_llama_cpp_gave_no_reason_for_points_to_verbose(tmp_path):
    from cli.engine.loading import load_failure as _load_failure
    from cli.errors import SilentLoadError

    silent = _load_failure(tmp_path / "m.gguf", [])
    assert isinstance(silent, SilentLoadError) and "--" not in str(silent)
    assert user_message(silent).endswith("llama.cpp gave no reason (run with --verbose)")
    said = _load_failure(tmp_path / "m.gguf", ["llama_model_load: error loading model: bad"])
    assert not isinstance(said, SilentLoadError) and user_message(said).endswith("model: bad")


def test_speculation_settings_are_refused_with_facts_and_worded_with_the_flags():
    from cli.engine.speculative import SpecOptions
    from cli.errors import SpecOptionError

    lines = []
    for refused in (lambda: SpecOptions("fast"), lambda: SpecOptions("ngram", 0)):
        with pytest.raises(SpecOptionError) as caught:
            refused()
        assert "--" not in str(caught.value)
        lines.append(user_message(caught.value))
    with pytest.raises(SpecOptionError) as caught:
        SpecOptions("draft").need_draft(None)
    lines.append(user_message(caught.value))
    assert lines == [
        "--spec takes off, ngram, draft, not 'fast'",
        "--draft-tokens takes a count of at least 1, not 0",
        "--spec draft needs --draft NAME (a small model of the same family)",
    ]


def test_a_file_that_is_no_transcript_is_said_by_the_engine_and_worded_by_chat(tmp_path):
    from cli.store.transcripts import NotATranscriptError, read_transcript

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for continuing, advice in ((True, "choose another --transcript"), (False, "/save writes one")):
        with pytest.raises(NotATranscriptError) as caught:
            read_transcript(notes, continuing)
        assert "--" not in str(caught.value) and "/save" not in str(caught.value)
        assert str(caught.value).startswith(f"{notes} is not a quill chat transcript (")
        assert user_message(caught.value).endswith(advice)

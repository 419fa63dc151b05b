"""quill chat: the terminal REPL (or a scripted conversation on stdin) over a ChatSession; line
editing and history are the standard library's readline (bash's keys, nothing to install)."""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.commands import options as shared
from cli.commands.basemodel import warn_if_base
from cli.commands.speculation import DraftModel, DraftTokens, SpecMode, spec_options
from cli.commands.structured_options import (
    FormatOption,
    GrammarOption,
    SchemaMultiOption,
    SchemaOption,
    StrictOption,
    build_constraint,
    constrained_sampling,
    output_problem,
    system_with_schema,
)
from cli.commands.templating import ChatTemplateFile, Think, read_template_option
from cli.commands.wording import user_message
from cli.engine.backend import Backend
from cli.engine.chatsession import (
    OVERFLOW_POLICIES,
    RESTORED,
    ChatSession,
    ChatSettings,
    Turn,
    TurnStart,
    check_text,
    with_setting,
)
from cli.engine.settings import ModelSettings
from cli.errors import EXIT_CONTEXT_OVERFLOW, EXIT_OK, NotOursError, QuillError, UsageError
from cli.ui import render

if TYPE_CHECKING:
    from cli.engine.structured import Constraint

BLOCK = '"""'
HELP = """\
/help              this list
/clear             forget the conversation and its KV cache (the system prompt stays,
                   the transcript keeps the messages under "earlier")
/system TEXT       set the system prompt (/system alone removes it)
/set KEY VALUE     temperature, top_p, top_k, min_p, repeat_penalty, seed, max_tokens,
                   stop (comma-separated, backslash escapes: /set stop \\n\\n; /set stop clears),
                   threads N (fixed) or threads auto (judged again while replying)
/show              model, settings, context used of total, KV cache bytes, threads
/stats             the numbers of the last reply
/save FILE         write the transcript (JSON) to FILE
/load FILE         continue a saved conversation
/retry             answer the last message again
/think             the reasoning of the last reply, in full (replies show it folded)
/model NAME        switch to another model, keeping the conversation and the options
/bye               leave (also Ctrl-D, or Ctrl-C at an empty prompt)
\"\"\" ... \"\"\"        a message of several lines
Ctrl-C while a reply streams stops it; what was written is kept."""

# The commands that need an argument, and what it is.
USAGE = {
    "/set": "KEY VALUE, e.g. /set temperature 0.2",
    "/save": "FILE",
    "/load": "FILE",
    "/model": "NAME",
}
CHAT_EPILOG = (
    "The conversation is saved as it grows to the transcript file (default: "
    "$QUILL_HOME/chats/). With stdin not a terminal, each line is one message."
)


class Quit(Exception):
    pass


def chat(
    invocation: typer.Context,
    name: shared.ModelArgument = None,
    model: shared.ModelOption = None,
    system: shared.System = None,
    max_tokens: shared.MaxTokens = 512,
    temperature: shared.Temperature = shared.DEFAULT_SAMPLING.temperature,
    top_k: shared.TopK = shared.DEFAULT_SAMPLING.top_k,
    top_p: shared.TopP = shared.DEFAULT_SAMPLING.top_p,
    min_p: shared.MinP = shared.DEFAULT_SAMPLING.min_p,
    repeat_penalty: shared.RepeatPenalty = shared.DEFAULT_SAMPLING.repeat_penalty,
    seed: shared.Seed = None,
    stop: shared.Stop = None,
    ctx: shared.Ctx = None,
    on_overflow: Annotated[
        str,
        typer.Option(
            "--on-overflow",
            help="When the next turn does not fit: truncate (drop the oldest turns) or error.",
        ),
    ] = "truncate",
    transcript: Annotated[
        Path | None, typer.Option("--transcript", help="Where the conversation is saved.")
    ] = None,
    threads: shared.Threads = None,
    gpu_layers: shared.GpuLayers = None,
    rpc: shared.Rpc = None,
    kv_type: shared.KvType = "f16",
    kv_k: shared.KvK = None,
    kv_v: shared.KvV = None,
    repack: shared.Repack = "auto",
    no_stats: shared.NoStats = False,
    offline: shared.Offline = False,
    verbose: shared.Verbose = False,
    endpoint: shared.Endpoint = None,
    api_key: shared.ApiKey = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            help="Continue a saved chat with its model, settings and KV cache: last (the "
            "chat used last, --transcript ones too), or an ID (its file name, or its start).",
        ),
    ] = None,
    chat_template: ChatTemplateFile = None,
    think: Think = None,
    schema: SchemaOption = None,
    schema_multi: SchemaMultiOption = False,
    json_format: FormatOption = None,
    grammar: GrammarOption = None,
    strict: StrictOption = False,
    spec: SpecMode = "off",
    draft: DraftModel = None,
    draft_tokens: DraftTokens = None,
    list_chats: Annotated[
        bool,
        typer.Option(
            "--list",
            help="List the saved chats, the newest first: the ID --resume takes, when, turns, "
            "model, first words. Opens no model.",
        ),
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="With --list: one JSON array on stdout.")
    ] = False,
) -> None:
    """Chat with a model in the terminal: each turn prefills only what is new."""
    from dataclasses import replace

    from cli.commands.cache import ChatCacheReport
    from cli.store.promptcache import chat_cache
    from cli.store.transcripts import TranscriptFiles

    if list_chats or json_output:
        _list_chats(json_output, list_chats, [name, model, resume, transcript])
        return
    constraint = build_constraint(schema, schema_multi, json_format, grammar, strict)
    system = system_with_schema(system, constraint)
    speculation = spec_options(spec, draft, draft_tokens, endpoint, constraint)
    if on_overflow not in OVERFLOW_POLICIES:
        raise UsageError(f"--on-overflow takes truncate or error, not {on_overflow!r}")
    source = shared.model_source(endpoint, api_key, offline, rpc)
    chosen, transcript = _resumed(
        resume, transcript, shared.model_name(name, model), source.endpoint
    )
    options = shared.load_options(ctx, threads, gpu_layers, kv_type, kv_k, kv_v, rpc, repack=repack)
    template = read_template_option(chat_template)
    settings = ModelSettings(chat_template=template, think=think, spec=speculation)
    chosen, transcript = _model_and_transcript(chosen, transcript, source)

    def opener(settings: ModelSettings) -> Callable[[str | None], tuple[str, Backend]]:
        return lambda name: shared.open_backend(name, source, options, settings, verbose, repack)

    chat_settings = ChatSettings(
        sampling=constrained_sampling(
            shared.sampling_params(temperature, top_k, top_p, min_p, repeat_penalty, seed),
            constraint,
        ),
        max_tokens=max_tokens,
        stop=tuple(stop or ()),
        on_overflow=on_overflow,
    )
    given = _typed_settings(invocation)
    with contextlib.ExitStack() as held:
        transcript = _hold(transcript, held)
        # A model /model switches to starts without the chat's saved KV cache, the first's.
        label, backend = opener(replace(settings, prompt_cache=chat_cache(transcript)))(chosen)
        report = ChatCacheReport(backend, resumed=resume is not None)
        files = TranscriptFiles()
        session = ChatSession(
            backend, label, transcript, system, chat_settings, given, transcripts=files
        )
        if session.continued:
            render.info_line(f"continuing the {session.continued} messages in {transcript}")
        shown = shared.stats_shown(no_stats)
        repl = Repl(session, opener(settings), shown, constraint, report.after_turn)
        try:
            repl.run()
        finally:
            report.finish(session.backend)
    if repl.exit_code != EXIT_OK:  # each refusal had its error line when it happened
        raise typer.Exit(repl.exit_code)


def _resumed(
    resume: str | None, transcript: Path | None, chosen: str | None, endpoint: str | None
) -> tuple[str | None, Path | None]:
    """(model, transcript) of a chat that --resume continues: the transcript it finds, and the
    model the chat was held with where no model and no server is given (as `llm -c` does)."""
    if resume is None:
        return chosen, transcript
    from cli.store.chats import find_transcript

    if transcript is not None:
        raise UsageError("--resume names the transcript itself: drop --transcript")
    transcript = find_transcript(resume)
    if chosen is None and not endpoint:
        from cli.store.transcripts import saved_model

        chosen = saved_model(transcript)
    return chosen, transcript


def _model_and_transcript(
    chosen: str | None, transcript: Path | None, source: shared.ModelSource
) -> tuple[str | None, Path]:
    """The model to open (a server's first where it names none) and the transcript file (by
    default a new one under chats/, named for the time and the model)."""
    from cli.store.chats import new_transcript

    if transcript is not None and (not transcript.name or transcript.is_dir()):
        raise UsageError(f"--transcript {transcript} is a directory: give a file such as chat.json")
    if source.endpoint:
        chosen = source.served_name(chosen)
    if transcript is None:
        label = chosen if source.endpoint and chosen else shared.model_label(chosen)
        transcript = new_transcript(label)
    return chosen, transcript


def _list_chats(json_output: bool, list_chats: bool, chat_options: list[object]) -> None:
    """--list: the saved chats, the newest first, as a table or (--json) a JSON array."""
    import json

    from cli.store.chats import chat_summaries, chats_dir
    from cli.units import shortened

    if not list_chats:
        raise UsageError("--json goes with --list (a reply as JSON: --format json)")
    if any(option is not None for option in chat_options):
        raise UsageError("--list starts no chat: drop the model, --resume and --transcript")
    chats = chat_summaries()
    if json_output:
        objects = [
            {"id": c.id, "path": str(c.path), "saved": _when(c.written, "%Y-%m-%dT%H:%M:%S%z"),
             "model": c.model, "first_message": c.first, "turns": c.turns, "error": c.problem}
            for c in chats
        ]  # fmt: skip
        render.write_stdout(json.dumps(objects, ensure_ascii=False, indent=1) + "\n")
    elif not chats:
        render.info_line(f"no saved chats in {chats_dir()} yet: `quill chat` starts one")
    else:
        rows = [
            [c.id, _when(c.written, "%Y-%m-%d %H:%M"), str(c.turns), c.model or "?",
             shortened(c.first or ("(unreadable)" if c.problem else "(none yet)"), 50)]
            for c in chats
        ]  # fmt: skip
        render.write_stdout(render.columns(["ID", "SAVED", "TURNS", "MODEL", "FIRST"], rows, (2,)))
        render.info_line("continue one with `quill chat --resume ID`")


def _when(seconds: float, form: str) -> str:
    return time.strftime(form, time.localtime(seconds))


def _typed_settings(invocation: typer.Context) -> list[str]:
    """The settings a continued transcript restores that this command line gives again: those
    stand, the transcript's own for the rest."""
    source = invocation.get_parameter_source
    return [key for key in RESTORED if getattr(source(key), "name", "DEFAULT") != "DEFAULT"]


def _hold(transcript: Path, held: contextlib.ExitStack) -> Path:
    """The transcript this chat writes, locked until it ends: a copy where another chat has it
    open (each rewrites the whole file: one would lose the other's turns)."""
    from cli.store.chats import chat_lock, copy_transcript, note_used

    holder = held.enter_context(chat_lock(transcript))
    if holder is not None:
        copy = copy_transcript(transcript)
        render.warning_line(
            f"{transcript} is open in another quill chat"
            + (f" (pid {holder})" if holder else "")
            + f"; this one goes on in a copy, {copy}, so that neither loses turns (to continue "
            "the same file, leave the other chat first)"
        )
        transcript = copy
        held.enter_context(chat_lock(transcript))
    note_used(transcript)
    return transcript


class Repl:
    def __init__(
        self,
        session: ChatSession,
        open_model: Callable[[str], tuple[str, Backend]],  # what /model opens a model with
        show_stats: bool,
        constraint: Constraint | None = None,  # --schema and co.: each reply is checked
        after_turn: Callable[[], None] | None = None,  # the resumed KV cache's report
    ) -> None:
        self.session, self.open_model, self.show_stats = session, open_model, show_stats
        self.constraint, self.after_turn = constraint, after_turn
        self.interactive = sys.stdin.isatty()
        self.last_stats: str | None = None
        self.last_reasoning = ""  # what /think shows
        self.lines_read = 0
        # A turn refused because the conversation does not fit: the chat goes on, and ends
        # with exit 4, so that a script piping messages in can tell.
        self.exit_code = EXIT_OK

    # --- input ------------------------------------------------------------------------------

    def run(self) -> None:
        session = self.session
        backend = session.backend
        warn_if_base(session.model_name)
        if not backend.has_chat_template:
            render.warning_line(
                f"{session.model_name} has no chat template and no family quill knows (a base "
                "model?); the conversation is sent as 'user: ...' lines, which base models only "
                "continue"
            )
        if self.interactive:
            _history()
            where = (
                f"at {backend.server_url}"
                if backend.server_url
                else f"context {backend.n_ctx} tokens"
            )
            render.info_line(
                f"quill chat · {session.model_name} · {where} · "
                f"/help for commands, Ctrl-D to leave · transcript {session.transcript}"
            )
        try:
            for message in self._messages():
                try:
                    if message.startswith("/"):
                        self._command(message)
                    else:
                        self._stream(functools.partial(session.send, message))
                except (QuillError, ValueError) as error:
                    render.error_line(user_message(error))
                    if isinstance(error, QuillError) and error.exit_code == EXIT_CONTEXT_OVERFLOW:
                        self.exit_code = EXIT_CONTEXT_OVERFLOW
        except Quit:
            pass
        finally:
            if self.interactive:
                _history(save=True)
        render.info_line(f"transcript saved to {session.transcript}")

    def _messages(self) -> Iterator[str]:
        while True:
            mark = _history_length() if self.interactive else 0
            try:
                line = self._read(">>> ")
            except EOFError:
                if self.interactive:
                    render.write_stderr("\n")
                return
            except KeyboardInterrupt:
                render.write_stderr("\n")
                if self.interactive and _line_buffer():  # Ctrl-C drops a half-typed line
                    continue
                return
            text = line.strip()
            if text == BLOCK or (line.startswith(BLOCK) and not line.endswith(BLOCK)):
                block = self._block(text[len(BLOCK) :])
                if block is not None and self.interactive:
                    _remember_block(mark, BLOCK + block + BLOCK)
                if block is not None and block.strip() and self._valid(block):
                    yield block
                continue
            if len(text) > 2 * len(BLOCK) and text.startswith(BLOCK) and text.endswith(BLOCK):
                line = text[len(BLOCK) : -len(BLOCK)].strip("\n")  # a block, as up-arrow recalls
            if line.strip() and self._valid(line):
                yield line.strip() if line.strip().startswith("/") else line

    def _valid(self, text: str) -> bool:
        """Whether a line (or block) can be sent; if not, say why and go on with the next."""
        try:
            check_text(text)
        except ValueError as error:
            where = f"line {self.lines_read}" if not self.interactive else "that line"
            render.error_line(f"{where} is {error}")
            return False
        return True

    def _block(self, first: str) -> str | None:
        lines = [first] if first else []
        while True:
            try:
                line = self._read("... ")
            except EOFError:
                return "\n".join(lines)
            except KeyboardInterrupt:
                render.write_stderr("\n(message discarded)\n")
                return None
            if line.rstrip().endswith(BLOCK):
                lines.append(line.rstrip()[: -len(BLOCK)])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    def _read(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        # Bytes, decoded here: a line that is not UTF-8 must reach _valid (whatever the locale
        # makes of stdin's errors), to be refused alone.
        stdin = getattr(sys.stdin, "buffer", None)
        if stdin is None:
            line = sys.stdin.readline()
        else:
            line = stdin.readline().decode("utf-8", "surrogateescape")
        if not line:
            raise EOFError
        self.lines_read += 1
        return line.rstrip("\n")

    # --- output -----------------------------------------------------------------------------

    def _stream(self, turn: Callable[[], Turn]) -> None:
        from cli.engine.metrics import MetricsRecorder

        session = self.session
        recorder = MetricsRecorder()
        start: TurnStart | None = None
        pieces: list[str] = []
        events = turn()
        text_end = "\n"
        thoughts: list[str] = []
        folded = False  # the one line that stands for the reasoning has been written
        try:
            for item in events:
                if isinstance(item, TurnStart):
                    start = item
                    if item.dropped_messages:
                        render.warning_line(
                            f"the context window is full: dropped the {item.dropped_messages} "
                            "oldest messages to fit this turn (the model no longer sees them; "
                            "the transcript keeps them; --on-overflow error refuses instead)"
                        )
                    continue
                recorder.observe(item)
                thoughts.append(item.reasoning)
                thinking = recorder.thinking_tokens
                if not folded and thinking and (item.text or item.finish_reason):
                    render.info_line(f"(thought for {thinking} tokens; /think shows it)")
                    folded = True
                pieces.append(item.text)
                render.write_stdout(item.text)
                text_end = "\n" if not item.text else ("" if item.text.endswith("\n") else "\n")
        except KeyboardInterrupt:
            events.close()  # the session keeps the partial reply, marked interrupted
            session.save()  # in case the interrupt landed while a save was under way
            render.write_stdout("\n")
            render.warning_line("reply interrupted; what was written is kept")
            text_end = ""
        except BrokenPipeError:
            render.silence_stdout()
            raise Quit from None
        render.write_stdout(text_end)
        self.last_reasoning = "".join(thoughts)
        if recorder.last is None or start is None:
            return
        interrupted = "interrupted" if session.messages[-1].interrupted else None
        metrics = recorder.summary(session.backend, interrupted)
        used = session.context_used() if session.backend.manages_window else None
        shown = render.model_shown(session.model_name)
        self.last_stats = render.turn_stats_line(metrics, used, shown)
        if self.show_stats:
            render.info_line(self.last_stats)
        if self.after_turn is not None:
            self.after_turn()
        finish = metrics.finish_reason
        text = "".join(pieces)
        problem = output_problem(self.constraint, text, finish) if self.constraint else None
        if problem is not None:  # the chat goes on; the user is told, as run's exit 7 tells
            render.warning_line(f"this reply does not match the schema: {problem}")

    # --- slash commands ---------------------------------------------------------------------

    def _command(self, line: str) -> None:
        command, _, argument = line.partition(" ")
        argument, session = argument.strip(), self.session
        if command in USAGE and not argument:
            raise ValueError(f"usage: {command} {USAGE[command]}")
        if command in ("/bye", "/exit", "/quit"):
            raise Quit
        if command in ("/help", "/?"):
            render.write_stderr(HELP + "\n")
        elif command == "/clear":
            session.clear()
            render.info_line("conversation and KV cache cleared")
        elif command == "/system":
            session.set_system(argument)
            render.info_line("system prompt set" if argument else "system prompt removed")
        elif command == "/set" and argument.split()[0] == "threads":
            self._set_threads(argument.partition(" ")[2].strip())
        elif command == "/set":
            key, _, value = argument.partition(" ")
            session.settings = with_setting(session.settings, key, value.strip())
            render.info_line(f"{key} = {value.strip() or '(none)'}")
        elif command == "/show":
            self._show()
        elif command == "/stats":
            render.info_line(self.last_stats or "no reply yet")
        elif command == "/save":
            session.save(Path(argument).expanduser())
            render.info_line(f"saved to {argument}")
        elif command == "/load":
            session.load(Path(argument).expanduser())
            render.info_line(f"loaded {len(session.messages)} messages from {argument}")
        elif command == "/retry":
            self._stream(session.retry)
        elif command == "/think":
            shown = self.last_reasoning or "(no reasoning in the last reply)"
            render.write_reasoning(shown + "\n")
        elif command == "/model":
            self._switch_model(argument)
        else:
            raise ValueError(f"unknown command {command}; /help lists the commands")

    def _show(self) -> None:
        from cli.units import human_bytes

        session, backend = self.session, self.session.backend
        sampling, settings = session.settings.sampling, session.settings
        where = f"at {backend.server_url}" if backend.server_url else f"({backend.location})"
        lines = [f"model      {session.model_name} {where}"]
        lines.append(f"system     {session.system or '(none)'}")
        if backend.samples_here:
            lines.append(
                f"sampling   temperature {sampling.temperature}, top_k {sampling.top_k}, "
                f"top_p {sampling.top_p}, min_p {sampling.min_p}, "
                f"repeat_penalty {sampling.repeat_penalty}, seed {sampling.seed}"
            )
        else:
            lines.append(
                f"sampling   temperature {sampling.temperature}, top_p {sampling.top_p}, "
                f"seed {sampling.seed} (the server applies its own top_k and min_p)"
            )
        replies = f"replies    max_tokens {settings.max_tokens}, stop {list(settings.stop)}"
        if backend.manages_window:
            lines.append(f"{replies}, on overflow {settings.on_overflow}")
            lines.append(
                f"context    {session.context_used()} of {backend.n_ctx} tokens used, "
                f"{len(session.messages)} messages"
            )
        else:
            lines.append(replies)
            lines.append(
                f"context    {len(session.messages)} messages (the server keeps the cache)"
            )
        if backend.reports_runtime:
            lines.append(
                f"KV cache   {backend.kv_type_k}/{backend.kv_type_v}, "
                f"{human_bytes(backend.kv_cache_bytes)} allocated"
            )
            judged = "fixed" if backend.core_load is None else "auto (judged again while replying)"
            lines.append(f"threads    {backend.threads}, {judged}")
        lines.append(f"transcript {session.transcript}")
        render.write_stderr("\n".join(lines) + "\n")

    def _set_threads(self, value: str) -> None:
        backend = self.session.backend
        most = shared.MAX_THREADS  # llama.cpp's
        if value != "auto" and not (value.isdigit() and 1 <= int(value) <= most):
            raise ValueError(f"threads takes a whole number 1 to {most}, or auto, not {value!r}")
        try:
            backend.set_threads(None if value == "auto" else int(value))
        except NotOursError as error:
            raise ValueError(f"{error} (quill serve -t N sets them)") from error
        now = f" ({backend.threads} now)" if value == "auto" else ""
        render.info_line(f"threads = {value}{now}")

    def _switch_model(self, name: str) -> None:
        """Open NAME as the first model was opened: locally with the chat's options, or, in a
        chat with --endpoint, as the server's model NAME (as ollama's /load asks its server)."""
        label, backend = self.open_model(name)
        self.session.backend.close()
        self.session.backend, self.session.model_name = backend, label
        self.session.save()
        where = f" at {backend.server_url}" if backend.server_url else ""
        render.info_line(f"now chatting with {label}{where}; the conversation is kept")
        warn_if_base(label)


def _history(save: bool = False) -> None:
    """Read, or save, the lines typed before (QUILL_HOME/chat_history) where readline exists."""
    from cli.store.models import quill_home

    with contextlib.suppress(ImportError, OSError):  # no readline (Windows), no history yet
        import readline

        path = quill_home() / "chat_history"
        if save:
            path.parent.mkdir(parents=True, exist_ok=True)
            _rewrite_history(readline, lambda entry: entry.replace("\n", NEWLINE))
            readline.write_history_file(path)
        else:
            readline.set_history_length(1000)
            readline.read_history_file(path)
            _rewrite_history(readline, lambda entry: entry.replace(NEWLINE, "\n"))


NEWLINE = "\u2424"  # a block's newlines in the history file, which holds an entry a line


def _rewrite_history(readline: Any, change: Callable[[str], str]) -> None:
    for index in range(readline.get_current_history_length()):
        entry = readline.get_history_item(index + 1) or ""
        if change(entry) != entry:
            readline.replace_history_item(index, change(entry))


def _history_length() -> int:
    try:
        import readline

        return readline.get_current_history_length()
    except ImportError:  # pragma: no cover
        return 0


def _remember_block(mark: int, block: str) -> None:
    """Make the lines of a block, readline's entries since mark, one entry that the up arrow
    recalls whole (and that is sent as the block again)."""
    with contextlib.suppress(ImportError):
        import readline

        while readline.get_current_history_length() > mark:
            readline.remove_history_item(readline.get_current_history_length() - 1)
        readline.add_history(block)


def _line_buffer() -> str:
    try:
        import readline

        return readline.get_line_buffer()
    except ImportError:  # pragma: no cover
        return ""

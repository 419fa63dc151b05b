from cli.engine.textstream import TextStream


def feed(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.push(piece) for piece in pieces]


def test_multibyte_characters_split_across_pieces_come_out_whole():
    text = "你好 🌍!"
    data = text.encode()
    pieces = [data[i : i + 1] for i in range(len(data))]  # one byte per "token"
    stream = TextStream()
    chunks = [*feed(stream, pieces), stream.finish()]
    assert "".join(chunks) == text
    assert all("\ufffd" not in chunk for chunk in chunks)
    assert "你" in chunks  # released as soon as its third byte arrived, not at the end


def test_stop_string_split_across_tokens_is_caught_and_not_printed():
    stream = TextStream(stop=["\n\n"])
    out = feed(stream, [b"Hello", b"\n", b"\n", b"World"])
    assert "".join(out) == "Hello"
    assert stream.matched_stop == "\n\n"
    assert stream.finish() == ""


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop():
    stream = TextStream(stop=["\n\n"])
    assert stream.push(b"a\n") == "a"
    assert stream.push(b"b") == "\nb"
    assert stream.matched_stop is None


def test_earliest_match_wins_regardless_of_list_order():
    stream = TextStream(stop=["END", "."])
    out = stream.push(b"One. Two END")
    assert out == "One"
    assert stream.matched_stop == "."


def test_unfinished_prefix_is_flushed_at_the_end():
    stream = TextStream(stop=["###"])
    assert stream.push(b"done ##") == "done "
    assert stream.finish() == "##"
    assert stream.matched_stop is None


def test_stop_string_completed_by_the_final_flush():
    stream = TextStream(stop=["é"])
    assert stream.push("aé".encode()[:-1]) == "a"  # the é is incomplete
    assert stream.finish() == "\ufffd"  # invalid UTF-8 at the very end is shown, not hidden

"""quill list's memo of what each model file is for (cli/store/kinds.py): a file is read once
while it stays as it is, again when it changes, and a damaged memo is read as none."""

from __future__ import annotations

import os
import shutil

import pytest

from cli.store import kinds


@pytest.fixture
def files(tmp_path, monkeypatch, tiny_path, tiny_bert_path, tiny_reranker_path):
    """Copies of a generation model, an embedding model and a reranker in a fresh home, and a
    list that records each header read."""
    monkeypatch.setenv("QUILL_HOME", str(tmp_path / "home"))
    copies = []
    for source in (tiny_path, tiny_bert_path, tiny_reranker_path):
        copies.append(tmp_path / source.name)
        shutil.copyfile(source, copies[-1])
    reads: list[str] = []
    read = kinds.file_kind

    def counted(path):
        reads.append(path.name)
        return read(path)

    monkeypatch.setattr(kinds, "file_kind", counted)
    return copies, reads


def test_each_file_is_read_once_while_it_stays_as_it_is(files):
    copies, reads = files
    first = kinds.file_kinds(copies)
    assert list(first.values()) == ["generation", "embedding", "rerank"]
    assert len(reads) == 3 and kinds.memo_path().exists()
    assert kinds.file_kinds(copies) == first and len(reads) == 3
    # A file replaced (another size, another time) is read again; the others are not.
    shutil.copyfile(copies[1], copies[0])
    os.utime(copies[0], ns=(10**18, 10**18))
    again = kinds.file_kinds(copies)
    assert again[str(copies[0])] == "embedding" and reads[3:] == [copies[0].name]


def test_a_damaged_memo_or_entry_is_read_as_none(files):
    copies, reads = files
    kinds.file_kinds(copies)
    kinds.memo_path().write_text('{"truncated": [1, 2, ', encoding="utf-8")
    assert list(kinds.file_kinds(copies).values()) == ["generation", "embedding", "rerank"]
    assert len(reads) == 6
    memo = kinds.memo_path().read_text(encoding="utf-8")
    kinds.memo_path().write_text(memo.replace('"rerank"', '"weights"'), encoding="utf-8")
    assert kinds.file_kinds(copies)[str(copies[2])] == "rerank" and len(reads) == 7


def test_a_file_that_is_no_gguf_or_gone_is_none_and_not_remembered(files, tmp_path):
    copies, _ = files
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 3)
    gone = tmp_path / "gone.gguf"
    assert kinds.file_kinds([broken, gone, copies[0]]) == {
        str(broken): None, str(gone): None, str(copies[0]): "generation",
    }  # fmt: skip
    assert str(broken) not in kinds.memo_path().read_text(encoding="utf-8")
    copies[0].unlink()  # a file removed leaves the memo at its next write
    kinds.file_kinds([copies[1]])
    assert str(copies[0]) not in kinds.memo_path().read_text(encoding="utf-8")

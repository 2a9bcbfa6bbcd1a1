"""Incremental detokenization: multi-byte characters across tokens, spaces, stop strings."""

from __future__ import annotations

import pytest

from conftest import make_tokenizer_files
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tokenizer_files(str(path))
    return Tokenizer(str(path))


@pytest.mark.parametrize("text", ["Hello world, the quick brown fox.", "Zwölf Boxkämpfer 東京は 🚀🚀 ok",
                                  "  spaced   out\n\nlines"])
def test_streamed_text_equals_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("prompt:", add_special_tokens=False))
    pieces = []
    for i in ids:
        before = len(d.text)
        d.add(i)
        pieces.append(d.text[before:])
        assert "\ufffd" not in d.text
    d.flush()
    assert d.text == tok.decode(ids) == text


def test_stop_string_spanning_tokens_is_cut_and_held_back(tok):
    text = "The quick brown fox jumps over"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["fox jum"])
    for i in ids:
        d.add(i)
        # Never stream a prefix of the stop string before we know.
        assert "fox" not in d.text[: d.stream_len] or d.stopped_by
        if d.stopped_by:
            break
    assert d.stopped_by == "fox jum"
    assert d.text == "The quick brown "


def test_include_stop_string(tok):
    ids = tok.encode("a b c d e", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["c"], include_stop_str_in_output=True)
    for i in ids:
        d.add(i)
        if d.stopped_by:
            break
    assert d.text == "a b c"


def test_chat_template_renders(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>user: hi</s><s>assistant:"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.bos_token_id

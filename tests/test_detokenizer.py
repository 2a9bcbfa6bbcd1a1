"""Incremental detokenization: multi-byte characters across tokens, spaces, stop strings."""

from __future__ import annotations

import json

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


def test_no_text_longer_than_max_chars_encodes_within_the_token_count(tok, tmp_path):
    """max_chars(n) bounds the characters of every text of at most n tokens, so that a prompt longer than it
    can be refused untokenized; the texts that pack the most characters a token are runs of its longest
    entries, special tokens among them."""
    vocab = tok.tk.get_vocab()
    longest = [tok.decode([vocab[t]]) for t in sorted(vocab, key=len)[-3:]]
    texts = ["Hello world, the quick brown fox.", "Zwölf Boxkämpfer 東京は 🚀🚀 ok", " " * 500, "a" * 3000,
             "".join(longest) * 40, "<s></s>" * 100, "\x00\x01" * 50]
    for text in texts:
        n = len(tok.encode(text))
        assert len(text) <= tok.max_chars(n), text[:40]
    assert tok.max_chars(8192) < 8192 * 100

    # A normalizer that deletes characters leaves no bound.
    make_tokenizer_files(str(tmp_path))
    with open(tmp_path / "tokenizer.json") as f:
        spec = json.load(f)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "StripAccents"}]}
    with open(tmp_path / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    assert Tokenizer(str(tmp_path)).max_chars(8192) is None


def test_text_held_back_is_the_longest_end_that_could_begin_a_stop_string(tok):
    """The streamable length leaves out exactly the longest end of the text that is a proper beginning of some
    stop string (compared here with that definition spelled out, on texts and stop strings over two letters,
    where such ends overlap the most)."""
    import random

    rng = random.Random(0)
    d = IncrementalDetokenizer(tok, [])
    for _ in range(3000):
        d.text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        d.stop = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 12))) for _ in range(rng.randrange(1, 4))]
        hold = max((k for s in d.stop for k in range(1, min(len(s) - 1, len(d.text)) + 1)
                    if d.text.endswith(s[:k])), default=0)
        assert d.stream_len == len(d.text) - hold, (d.text, d.stop)


def test_stop_strings_and_logit_bias_are_bounded_by_what_one_request_may_cost_the_others():
    """Stop strings are matched on the coordinator's event loop for every token: a thousand of a thousand
    characters took 0.1 s a token there, stalling every stream; requests past the bounds are refused."""
    from engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams

    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS, logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS)})
    with pytest.raises(ValueError, match=r"^stop takes at most 32 strings of at most 256 characters, got .{0,220}$"):
        SamplingParams(stop=["x" * 10_000] * 1000)
    with pytest.raises(ValueError, match="stop takes at most"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match=r"^logit_bias takes at most 1024 tokens, got .{0,220}$"):
        SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)})
    SamplingParams(stop_token_ids=list(range(1024)))
    with pytest.raises(ValueError, match=r"^stop_token_ids takes at most 1024 ids"):
        SamplingParams(stop_token_ids=list(range(1025)))

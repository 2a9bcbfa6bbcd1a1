"""A GGUF file's tokenizer as a `tokenizers` pipeline: tokenizer.json and tokenizer_config.json contents.

GGUF keeps the vocabulary, not the pipeline. llama.cpp names two kinds of it that our model families use:
byte-level BPE ("gpt2": Llama 3, Qwen2/3, SmolLM, Mistral's Tekken), whose merges the file lists and whose
text split depends on `tokenizer.ggml.pre`; and SentencePiece BPE ("llama": Llama 2, Mistral 7B up to v0.3),
whose file lists scores instead of merges. For the latter a pair merges when the piece it makes is in the
vocabulary, and pieces of higher score merge first, which is how SentencePiece's BPE applies its scores.
"""

from __future__ import annotations

import json
from typing import Callable

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, for byte-level BPE vocabularies.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Nemo, Small): cased words split apart, single digits.
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
           "tekken": _TEKKEN_SPLIT}

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def tokenizer_files(field: Callable, path: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) contents; `field(key, default)` reads the file's metadata."""
    from tokenizers import AddedToken

    kind = field("tokenizer.ggml.model")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tk = _byte_level(tokens, field("tokenizer.ggml.merges"), field("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        scores = field("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"{path}: a SentencePiece vocabulary without scores")
        unk = field("tokenizer.ggml.unknown_token_id")
        tk = _sentencepiece(tokens, scores, tokens[unk] if unk is not None else None,
                            bool(field("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                         f"SentencePiece BPE 'llama' are); pass a tokenizer directory with tokenizer.json instead")
    # Control and user-defined tokens must match whole in text, never be split by BPE.
    tk.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                   for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)])
    bos = field("tokenizer.ggml.bos_token_id")
    eos = field("tokenizer.ggml.eos_token_id")
    tk_config = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "chat_template": field("tokenizer.chat_template"),
        # Whether a prompt starts with BOS, as the file says (llama.cpp reads the same key; a SentencePiece
        # file that does not say takes BOS, as llama.cpp gives it). Llama 3 files say so, as its own
        # tokenizer.json does; chat templates write their BOS themselves.
        "add_bos_token": bool(field("tokenizer.ggml.add_bos_token", kind == "llama")),
    }
    return json.loads(tk.to_str()), tk_config


def _byte_level(tokens: list[str], merges: list[str], pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                              merges=[tuple(m.split(" ", 1)) for m in merges]))
    split = _SPLITS.get(pre)
    if split is None:  # GPT-2's own split
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(tokens: list[str], scores: list[float], unk: str | None, space_prefix: bool):
    """SentencePiece BPE: spaces as "▁", a "▁" before the text (`space_prefix`), characters outside the
    vocabulary as their UTF-8 bytes (<0xNN> tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(tokens, scores), unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if space_prefix else "never",
                                                split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:  # the "▁" put before the text is not part of it
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a piece into two pieces of the
    vocabulary, ranked by the whole piece's score (highest first), then by the longer left part, then the
    longer right part; ties keep vocabulary order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in zip(tokens, scores):
        pairs = [(piece[:j], piece[j:]) for j in range(1, len(piece)) if piece[:j] in vocab and piece[j:] in vocab]
        pairs.sort(key=lambda p: (vocab[p[0]], vocab[p[1]]))
        found.extend((-score, -len(left), -len(right), left, right) for left, right in pairs)
    found.sort(key=lambda m: m[:3])  # stable: equal keys stay in the order found
    return [(m[3], m[4]) for m in found]

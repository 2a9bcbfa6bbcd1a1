"""Tokenizer (HF `tokenizers`) and chat template (jinja2), read from a model directory."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.config import read_json


def _token_str(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        tk_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tk_file):
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        try:
            self.tk = HFTokenizer.from_file(tk_file)
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise ValueError(f"{tk_file}: not a readable tokenizer ({e})") from e
        cfg: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            cfg = read_json(cfg_file)
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        self.bos_token_id = self.tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tk.token_to_id(self.eos_token) if self.eos_token else None
        # Legacy Llama tokenizers ask for BOS in the config rather than in tokenizer.json's post-processor.
        self._prepend_bos = bool(cfg.get("add_bos_token")) and self.bos_token_id is not None and (
            self.tk.encode("a").ids[:1] != [self.bos_token_id]
        )
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._longest_entry: int | None = None  # (max_chars)
        self._growth = 0
        self.chat_template = template
        self._template = _compile(template) if template else None

    def max_chars(self, tokens: int) -> int | None:
        """The longest text that can encode to at most `tokens` tokens (None: no bound known), so that a prompt
        longer than any that fits the context is refused without tokenizing it. No token stands for more
        characters than its vocabulary entry has (byte-level entries hold a character per byte, byte-fallback
        entries six for one). Unicode composition in a normalizer joins at most a few code points into one;
        normalizers that delete characters leave no bound."""
        if self._longest_entry is None:
            norm = json.loads(self.tk.to_str()).get("normalizer")
            deleting = False

            def walk(n):
                nonlocal deleting
                if isinstance(n, dict):
                    kind = n.get("type")
                    deleting |= kind in ("StripAccents", "Strip", "BertNormalizer", "Precompiled") or (
                        kind == "Replace" and n.get("content") == "")
                    for sub in n.get("normalizers") or []:
                        walk(sub)

            walk(norm)
            longest = max((len(t) for t in self.tk.get_vocab(with_added_tokens=True)), default=1)
            self._growth = 0 if deleting else 1 if norm is None else 4
            self._longest_entry = longest
        return None if self._growth == 0 else tokens * self._longest_entry * self._growth

    def vocab_digest(self) -> str:
        """A short fingerprint of what each token id means (the vocabulary, added tokens included): a
        coordinator serves only workers whose ids mean what its own tokenizer's do."""
        vocab = sorted(self.tk.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
        return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; ValueError for text that is not Unicode (JSON's escapes can carry a lone
        surrogate, which no tokenizer takes)."""
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"the text is not valid Unicode: a lone surrogate {text[e.start]!r} at "
                                 f"character {e.start}") from None
        ids = self.tk.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        # The template writes the special tokens itself; encoding must not add more.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)

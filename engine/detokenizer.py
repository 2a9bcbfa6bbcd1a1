"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters (a UTF-8 character can span tokens) and loses the
spaces that depend on the previous token, so each step decodes a short window that starts a few tokens back
(`prefix_offset`) and emits only what is new past `read_offset`. Text ending in U+FFFD is an incomplete
character: hold it until the next token completes it.

Stop strings are searched in the text produced so far; `stream_len` is how much of the text is safe to send
to a client, i.e. cannot turn out to be the start of a stop string.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        self.skip_special = skip_special_tokens
        self.text = ""
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> None:
        """Append one generated token; may set `stopped_by` when a stop string appears."""
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
        full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            if self.stop:
                self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        longest = max(len(s) for s in self.stop)
        window_start = max(0, new_from - longest + 1)
        best = None
        for s in self.stop:
            i = self.text.find(s, window_start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stopped_by = s

    def flush(self) -> None:
        """At the end of generation, emit whatever an incomplete character held back."""
        if self.stopped_by is None and self.read_offset < len(self.ids):
            dec = self.tokenizer.decode
            prefix = dec(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special)
            full = dec(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special)
            if len(full) > len(prefix):
                self.text += full[len(prefix):]
            self.read_offset = len(self.ids)

    @property
    def stream_len(self) -> int:
        """Length of the text prefix that can be streamed without risk of being cut by a stop string."""
        if self.stopped_by is not None or not self.stop:
            return len(self.text)
        hold = 0
        for s in self.stop:
            # Longest suffix of the text that is a proper prefix of s: the first place in the text's last
            # len(s) - 1 characters from which the rest is where s begins. Only places holding s's first
            # character are tried, each by one C-level comparison (the naive loop over every length sliced
            # s each time: 0.1 s a token for a thousand stop strings of a thousand characters).
            tail = self.text[len(self.text) - min(len(s) - 1, len(self.text)):]
            j = tail.find(s[0])
            while j >= 0 and len(tail) - j > hold:
                if s.startswith(tail[j:]):
                    hold = len(tail) - j
                    break
                j = tail.find(s[0], j + 1)
        return len(self.text) - hold

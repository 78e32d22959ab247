"""Incremental detokenization and stop-string matching for one request (vLLM's rules).

``tokenizers.decoders.DecodeStream`` emits only whole UTF-8 characters, so deltas always
concatenate to the final text. While running, the last ``max(len(stop)) - 1`` characters
are held back; stop strings count only from ``min_tokens`` tokens on; an ending EOS/stop
token id keeps its id but not its text (unless ``include_stop_str_in_output``).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Detokenizer over a ``transformers`` fast tokenizer with one request's stop rules."""

    def __init__(self, tokenizer, stop: list[str], include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0):
        self._tok = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self.num_tokens = 0
        self.text = ""
        self.sent = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add tokens; returns the stop string matched (text truncated there) or None.
        ``stop_terminated``: the last token was an ending EOS/stop id (text not added)."""
        last = len(new_token_ids) - 1
        for k, t in enumerate(new_token_ids):
            if stop_terminated and k == last and not self.include_stop:
                self.num_tokens += 1
                return None
            start = len(self.text)
            piece = self._stream.step(self._tok, t)
            if piece:
                self.text += piece
            self.num_tokens += 1
            if self.stop and len(self.text) > start and self.num_tokens >= self.min_tokens:
                lo = max(0, start - self.hold)
                best = None
                for s in self.stop:
                    i = self.text.find(s, lo)
                    if i != -1 and (best is None or i < best[0]):
                        best = (i, s)
                if best is not None:
                    i, s = best
                    self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
                    return s
        return None

    def delta(self, finished: bool) -> str:
        """Text not yet returned; while running, hold back a possible stop-string prefix."""
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        d = self.text[self.sent:end]
        self.sent = end
        return d

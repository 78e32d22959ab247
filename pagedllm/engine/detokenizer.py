"""Incremental detokenization and stop-string matching for one request.

Text is produced with ``tokenizers.decoders.DecodeStream``, which emits a piece only once
the bytes seen so far form whole UTF-8 characters, so a streamed Korean or emoji answer
never contains a broken character and the deltas concatenate to the final text.
Stop strings are searched in the produced text; while a request runs, the last
``max(len(stop)) - 1`` characters are held back so a stop string split across tokens is
never streamed before it is recognised. As in vLLM, stop strings are not looked for
until ``min_tokens`` tokens exist (text completed before then is not searched again).
Also as in vLLM, the token that ended a request by being an EOS or stop token id stays in
the token ids but its text is left out (unless ``include_stop_str_in_output``).
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Args:
        tokenizer: a ``transformers`` fast tokenizer.
        stop: stop strings; include_stop_str_in_output: keep the matched stop string, and
            the text of an EOS / stop token id that ended the request.
        skip_special_tokens: drop special tokens from the text.
        min_tokens: stop strings count only from this many generated tokens on.
    """

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

        ``stop_terminated``: the last of ``new_token_ids`` ended the request as an EOS or
        stop token id (the engine core's finish_reason "stop"); its text is not added
        unless ``include_stop_str_in_output``. It still counts in ``num_tokens``.
        """
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

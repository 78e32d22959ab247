"""Request generators for ``pagedllm bench serve``: each dataset yields :class:`Session` s
(one or more :class:`Turn` s, each sent after the previous reply plus a think time).

``random`` (token-id prompts, lengths uniform on ``[L*(1-r), L*(1+r)]``),
``shared-prefix`` (one of ``num_prefixes`` fixed prefixes + a random suffix),
``multi-turn`` (agent-like chat sessions resending the growing conversation),
``sharegpt`` (first exchange of each conversation of a ShareGPT JSON file); ``trace`` (a
replayed trace file) is :mod:`~pagedllm.benchmarks.traces`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = [
    "Turn",
    "Session",
    "TokenSource",
    "Dataset",
    "RandomDataset",
    "SharedPrefixDataset",
    "MultiTurnDataset",
    "ShareGPTDataset",
    "DatasetError",
    "sample_lengths",
]


class DatasetError(ValueError):
    """A dataset file or dataset option is invalid; the message names the flag or line."""


@dataclass
class Turn:
    """One request of a session: ``prompt`` (completions: text or token ids), ``message``
    (chat content appended before this turn), ``prompt_len`` (estimated prompt tokens; exact
    for token ids), ``output_len`` (``max_tokens``), ``think_time_s`` (pause after the
    previous reply, seconds), ``abort_after_tokens`` (the client closes the stream after
    that many tokens, overriding ``--abort-fraction``; >= ``output_len`` = read to the end;
    None = the flags decide: :mod:`~pagedllm.benchmarks.load_model`)."""

    output_len: int
    prompt: str | list[int] | None = None
    message: str | None = None
    prompt_len: int = 0
    think_time_s: float = 0.0
    abort_after_tokens: int | None = None


@dataclass
class Session:
    """A unit of arrival: ``turns`` sent in order; ``kind`` "completions" or "chat";
    ``arrival_s`` (seconds from the run start) for timed datasets, else None;
    ``system_tokens`` the system prompt's length where the dataset knows it (else the
    runner counts ``system_prompt``; None: no system prompt)."""

    session_id: str
    turns: list[Turn]
    kind: str = "completions"
    system_prompt: str | None = None
    arrival_s: float | None = None
    system_tokens: int | None = None


_FALLBACK_VOCAB = (1000, 20000)
_WORDS = (
    "the of and to in is for on that with as by at from this be it are or an was "
    "data model token request server cache batch layer time value list file run "
    "read write open close start stop queue graph node edge user agent tool call "
    "result error count size page block memory input output state step loop"
).split()


class TokenSource:
    """Token ids and text for synthetic prompts, from an optional HF-style tokenizer. Without
    one, ids come from [1000, 20000) and text is English words counted one token each (an
    estimate); ``id_limit`` keeps random ids below it."""

    def __init__(self, tokenizer: Any | None = None, id_limit: int | None = None):
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.allowed_ids = np.arange(*_FALLBACK_VOCAB, dtype=np.int64)
            return
        try:
            size = len(tokenizer)
        except TypeError:
            size = int(getattr(tokenizer, "vocab_size"))
        banned = set(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []))
        get_added = getattr(tokenizer, "get_added_vocab", None)
        if callable(get_added):
            try:
                banned |= set(int(i) for i in get_added().values())
            except Exception:  # noqa: BLE001 - optional API
                pass
        ids = np.arange(min(size, id_limit) if id_limit else size, dtype=np.int64)
        if banned:
            ids = ids[~np.isin(ids, np.fromiter(banned, dtype=np.int64))]
        if ids.size == 0:
            raise DatasetError("tokenizer has no usable (non-special) token ids")
        self.allowed_ids = ids

    @property
    def exact(self) -> bool:
        """True when token counts come from a real tokenizer."""
        return self.tokenizer is not None

    def random_ids(self, n: int, rng: np.random.Generator) -> list[int]:
        """``n`` random non-special token ids."""
        if n <= 0:
            return []
        return [int(x) for x in rng.choice(self.allowed_ids, size=n)]

    def count(self, text: str) -> int:
        """Tokens in ``text`` (tokenizer count, else word count)."""
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; raises ``DatasetError`` without a tokenizer."""
        if self.tokenizer is None:
            raise DatasetError("turning token ids into text needs a tokenizer (--tokenizer)")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def text(self, n: int, rng: np.random.Generator) -> tuple[str, int]:
        """Random text of about ``n`` tokens; returns ``(text, estimated_tokens)``."""
        if n <= 0:
            return "", 0
        if self.tokenizer is None:
            words = rng.choice(np.asarray(_WORDS), size=n)
            return " ".join(str(w) for w in words), n
        # Decode random ids, re-encode and cut to n so the text is close to n tokens.
        text = self.decode(self.random_ids(n, rng))
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:n]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text, self.count(text)


def sample_lengths(mean: int, range_ratio: float, n: int, rng: np.random.Generator, flag: str) -> np.ndarray:
    """``n`` integer lengths uniform on ``[floor(mean*(1-r)), ceil(mean*(1+r))]``, at least 1.
    Raises ``DatasetError`` naming ``flag`` for ``mean < 1`` or ``r`` outside [0, 1)."""
    if mean < 1:
        raise DatasetError(f"{flag} must be >= 1, got {mean}")
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(np.floor(mean * (1 - range_ratio))))
    hi = max(lo, int(np.ceil(mean * (1 + range_ratio))))
    return rng.integers(lo, hi + 1, size=n)


class Dataset:
    """Base class: ``sessions(seed)`` yields sessions (possibly forever)."""

    name = "base"
    kind = "completions"
    timed = False  # True: sessions carry arrival_s and ignore --request-rate

    def sessions(self, seed: int) -> Iterator[Session]:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> dict:
        """Parameters for the saved result."""
        return {"name": self.name}


class RandomDataset(Dataset):
    """Random token-id prompts of ``input_len`` (+/- ``range_ratio``) tokens,
    ``output_len`` (+/- ``range_ratio``) output tokens."""

    name = "random"

    def __init__(self, tokens: TokenSource, input_len: int, output_len: int, range_ratio: float = 0.0):
        sample_lengths(input_len, range_ratio, 0, np.random.default_rng(0), "--input-len")
        sample_lengths(output_len, range_ratio, 0, np.random.default_rng(0), "--output-len")
        self.tokens, self.input_len, self.output_len, self.range_ratio = tokens, input_len, output_len, range_ratio

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng(seed)
        i = 0
        while True:
            (il,) = sample_lengths(self.input_len, self.range_ratio, 1, rng, "--input-len")
            (ol,) = sample_lengths(self.output_len, self.range_ratio, 1, rng, "--output-len")
            ids = self.tokens.random_ids(int(il), rng)
            yield Session(f"r{i}", [Turn(output_len=int(ol), prompt=ids, prompt_len=len(ids))])
            i += 1

    def describe(self) -> dict:
        return {"name": self.name, "input_len": self.input_len, "output_len": self.output_len,
                "range_ratio": self.range_ratio}


class SharedPrefixDataset(Dataset):
    """Prompts = one of ``num_prefixes`` fixed ``prefix_len``-token prefixes
    (chosen uniformly at random) + a fresh ``suffix_len``-token suffix."""

    name = "shared-prefix"

    def __init__(self, tokens: TokenSource, num_prefixes: int, prefix_len: int, suffix_len: int,
                 output_len: int, range_ratio: float = 0.0):
        if num_prefixes < 1:
            raise DatasetError(f"--num-prefixes must be >= 1, got {num_prefixes}")
        if prefix_len < 0:
            raise DatasetError(f"--prefix-len must be >= 0, got {prefix_len}")
        if suffix_len < 0 or prefix_len + suffix_len < 1:
            raise DatasetError("--suffix-len must be >= 0 and --prefix-len + --suffix-len >= 1")
        sample_lengths(output_len, range_ratio, 0, np.random.default_rng(0), "--output-len")
        self.tokens = tokens
        self.num_prefixes, self.prefix_len, self.suffix_len = num_prefixes, prefix_len, suffix_len
        self.output_len, self.range_ratio = output_len, range_ratio

    def sessions(self, seed: int) -> Iterator[Session]:
        # Prefixes depend on the seed only, so warm-up and measured runs share them.
        prng = np.random.default_rng([seed, 1])
        prefixes = [self.tokens.random_ids(self.prefix_len, prng) for _ in range(self.num_prefixes)]
        rng = np.random.default_rng([seed, 2])
        i = 0
        while True:
            p = int(rng.integers(self.num_prefixes))
            suffix = self.tokens.random_ids(self.suffix_len, rng)
            (ol,) = sample_lengths(self.output_len, self.range_ratio, 1, rng, "--output-len")
            ids = prefixes[p] + suffix
            yield Session(f"p{p}-{i}", [Turn(output_len=int(ol), prompt=ids, prompt_len=len(ids))])
            i += 1

    def describe(self) -> dict:
        return {"name": self.name, "num_prefixes": self.num_prefixes, "prefix_len": self.prefix_len,
                "suffix_len": self.suffix_len, "output_len": self.output_len, "range_ratio": self.range_ratio}


class MultiTurnDataset(Dataset):
    """Agent-like chat sessions of ``num_turns`` requests: a shared ``system_len``-token system
    prompt, a ``input_len``-token user message, then per turn the assistant's actual reply and
    a ``tool_len``-token tool result (a user message "Tool result: ...", as not every template
    has a ``tool`` role), resent after ``think_time_s`` seconds."""

    name = "multi-turn"
    kind = "chat"

    def __init__(self, tokens: TokenSource, num_turns: int, system_len: int, input_len: int,
                 tool_len: int, output_len: int, think_time_s: float = 0.0):
        if num_turns < 1:
            raise DatasetError(f"--multi-turn-turns must be >= 1, got {num_turns}")
        for flag, v in (("--multi-turn-system-len", system_len), ("--multi-turn-tool-len", tool_len)):
            if v < 0:
                raise DatasetError(f"{flag} must be >= 0, got {v}")
        if input_len < 1:
            raise DatasetError(f"--input-len must be >= 1, got {input_len}")
        if output_len < 1:
            raise DatasetError(f"--output-len must be >= 1, got {output_len}")
        if think_time_s < 0:
            raise DatasetError(f"--multi-turn-think-time must be >= 0, got {think_time_s}")
        self.tokens = tokens
        self.num_turns, self.system_len, self.input_len = num_turns, system_len, input_len
        self.tool_len, self.output_len, self.think_time_s = tool_len, output_len, think_time_s

    def sessions(self, seed: int) -> Iterator[Session]:
        srng = np.random.default_rng([seed, 3])
        system, _ = self.tokens.text(self.system_len, srng)
        system = system or None
        rng = np.random.default_rng([seed, 4])
        i = 0
        while True:
            turns = []
            for t in range(self.num_turns):
                if t == 0:
                    body, n = self.tokens.text(self.input_len, rng)
                    msg = body
                else:
                    body, n = self.tokens.text(self.tool_len, rng)
                    msg = "Tool result:\n" + body
                turns.append(Turn(output_len=self.output_len, message=msg, prompt_len=n,
                                  think_time_s=self.think_time_s if t else 0.0))
            yield Session(f"m{i}", turns, kind="chat", system_prompt=system)
            i += 1

    def describe(self) -> dict:
        return {"name": self.name, "num_turns": self.num_turns, "system_len": self.system_len,
                "input_len": self.input_len, "tool_len": self.tool_len, "output_len": self.output_len,
                "think_time_s": self.think_time_s}


_HUMAN = {"human", "user"}
_BOT = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}


class ShareGPTDataset(Dataset):
    """First human -> assistant exchange of each conversation of a ShareGPT JSON file
    (``[{"conversations": [{"from", "value"}]}]``), shuffled with the seed and cycled. Output
    length: the reply's tokens (or ``output_len``). As vLLM's benchmark, pairs under 4 tokens
    or over ``max_prompt_len`` / ``max_total_len`` are dropped.
    Raises ``DatasetError`` for a missing/invalid file or no usable pair.
    """

    name = "sharegpt"
    kind = "chat"

    def __init__(self, tokens: TokenSource, path: str, output_len: int | None = None,
                 max_prompt_len: int = 1024, max_total_len: int = 2048):
        if not path:
            raise DatasetError("--dataset sharegpt needs --dataset-path FILE.json")
        if not os.path.isfile(path):
            raise DatasetError(f"--dataset-path: no such file: {path}")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise DatasetError(f"--dataset-path: cannot read ShareGPT JSON {path}: {e}") from None
        if not isinstance(data, list):
            raise DatasetError(f"--dataset-path: {path} must hold a JSON list of conversations")
        if output_len is not None and output_len < 1:
            raise DatasetError(f"--sharegpt-output-len must be >= 1, got {output_len}")
        self.tokens, self.path, self.output_len = tokens, path, output_len
        self.max_prompt_len, self.max_total_len = max_prompt_len, max_total_len
        self.raw: list[tuple[str, str]] = []
        for conv in data:
            turns = conv.get("conversations") or conv.get("conversation") if isinstance(conv, dict) else None
            if not isinstance(turns, list) or len(turns) < 2:
                continue
            first, second = turns[0], turns[1]
            if not (isinstance(first, dict) and isinstance(second, dict)):
                continue
            if str(first.get("from", first.get("role", ""))).lower() not in _HUMAN:
                continue
            if str(second.get("from", second.get("role", ""))).lower() not in _BOT:
                continue
            self.raw.append((str(first.get("value", first.get("content", ""))),
                             str(second.get("value", second.get("content", "")))))
        # Token counts are computed lazily (a full ShareGPT file has ~90k
        # conversations; a run needs only as many as it sends).
        self._lens: dict[int, tuple[int, int] | None] = {}
        if not any(self._usable(i) for i in range(len(self.raw))):
            raise DatasetError(f"--dataset-path: no usable human/assistant pair in {path}")

    def _usable(self, i: int) -> tuple[int, int] | None:
        """(prompt_len, output_len) of pair ``i``, or None when it is filtered out."""
        if i not in self._lens:
            prompt, reply = self.raw[i]
            pl = self.tokens.count(prompt)
            ol = self.output_len if self.output_len is not None else self.tokens.count(reply)
            ok = not (pl < 4 or ol < 4 or pl > self.max_prompt_len or pl + ol > self.max_total_len)
            self._lens[i] = (pl, ol) if ok else None
        return self._lens[i]

    @property
    def pairs(self) -> list[tuple[str, int, int]]:
        """All usable (prompt, prompt_len, output_len) pairs (tokenizes the whole file)."""
        return [(self.raw[i][0], *lens) for i in range(len(self.raw)) if (lens := self._usable(i))]

    def sessions(self, seed: int) -> Iterator[Session]:
        rng = np.random.default_rng([seed, 5])
        i = 0
        while True:
            for j in rng.permutation(len(self.raw)):
                lens = self._usable(int(j))
                if lens is None:
                    continue
                prompt = self.raw[int(j)][0]
                yield Session(f"g{i}", [Turn(output_len=lens[1], prompt=prompt, message=prompt, prompt_len=lens[0])],
                              kind="chat")
                i += 1

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "num_conversations": len(self.raw),
                "output_len": self.output_len, "max_prompt_len": self.max_prompt_len,
                "max_total_len": self.max_total_len}

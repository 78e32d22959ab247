"""Trace replay for ``pagedllm bench serve --dataset trace``. Formats (``--trace-format``):
``pagedllm`` (our JSONL: single requests, or chat sessions of turns), ``mooncake`` (JSONL;
``hash_ids`` name ``--trace-block-size``-token blocks: equal ids, identical prompt blocks,
so prefix reuse is replayed), ``azure`` (CSV: ``TIMESTAMP``, ``ContextTokens``,
``GeneratedTokens``), ``burstgpt`` (CSV: ``Timestamp``, ``Request tokens``, ``Response
tokens``); ``auto`` picks by extension and header. CSV rows with 0 prompt or output tokens
(BurstGPT's failed requests) are skipped and counted. Arrivals are relative to the first
request, divided by ``--trace-speedup``; think times are not. Prompt text is drawn from a
:class:`WordPool` of one-token words, so each prompt has exactly its recorded token count.
Without a path the shipped agent trace (:data:`AGENT_TRACE_PATH`) is replayed. Fields and
units: docs/traces.md. Bad files raise ``DatasetError`` naming ``--dataset-path`` and the line.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Iterator, Sequence

import numpy as np

from .datasets import _WORDS, Dataset, DatasetError, Session, TokenSource, Turn

__all__ = [
    "TRACE_FORMATS",
    "AGENT_TRACE_PATH",
    "TraceTurn",
    "TraceRecord",
    "WordPool",
    "word_pool",
    "TraceText",
    "detect_format",
    "read_trace",
    "TraceDataset",
]

TRACE_FORMATS = ("auto", "pagedllm", "mooncake", "azure", "burstgpt")
#: The synthetic agent trace shipped with the package (generator: ``agent_trace.py``).
AGENT_TRACE_PATH = os.path.join(os.path.dirname(__file__), "data", "agent_trace.jsonl")

_CHUNK = 512            # words per generated chunk of a content stream
_CACHED_CHUNKS = 8192   # chunks kept (1 KiB each)
_MIN_POOL = 64          # fewest one-token words a tokenizer must have
_MAX_CANDIDATES = 4000
_REQUIRED = object()


@dataclass
class TraceTurn(Turn):
    """A :class:`Turn` of a replayed trace, plus ``role`` ("user"; "tool": the message is a
    tool result, sent as a user message, and ``think_time_s`` is the tool's round trip).
    The record's ``abort_after_tokens`` is :class:`Turn`'s: the client stops reading after
    that many output tokens; None: ``--abort-fraction`` / ``--abort-after`` decide (read to
    the end at the default fraction 0)."""

    role: str = "user"


@dataclass
class TraceRecord:
    """One request as read. ``arrival_s``: seconds (absolute until loaded, then relative to
    the first request and divided by the speed-up; None on chat turns after the first);
    ``output_len``: max tokens; the prompt (or a chat turn's message) as ``prompt`` text or
    ``prompt_len`` tokens, with ``hash_ids`` blocks and ``message_id`` (equal ids, equal
    text); chat turns: ``turn`` (0-based), ``role``, ``think_time_s``, ``abort_after_tokens``
    and, on turn 0, ``system_prompt`` text or ``system_prompt_len`` + ``instruction_len``
    tokens of user ``user_id``; ``line``: the source line."""

    arrival_s: float | None
    output_len: int
    line: int
    prompt: str | None = None
    prompt_len: int | None = None
    hash_ids: list[int] = field(default_factory=list)
    session_id: str | None = None
    turn: int | None = None
    role: str = "user"
    message_id: str | None = None
    think_time_s: float = 0.0
    abort_after_tokens: int | None = None
    system_prompt: str | None = None
    system_prompt_len: int = 0
    user_id: str | None = None
    instruction_len: int = 0


# ---------------------------------------------------------------------------
# Prompt content: one-token words, and deterministic streams of them
# ---------------------------------------------------------------------------


class WordPool:
    """Words the token source counts as one token each, alone and after a space, so ``n``
    of them joined by spaces are exactly ``n`` tokens: ``words[i]`` and ``ids[i]`` (the id of
    ``" " + words[i]``). From the tokenizer's vocabulary; without one, English words
    (counted one token each) with ids ``1000 + i``. Raises ``DatasetError`` when the
    tokenizer has fewer than 64 such words or they do not join one token each."""

    def __init__(self, tokens: TokenSource):
        tok = tokens.tokenizer
        if tok is None:
            words = sorted(set(_WORDS))
            self.words, self.ids = np.asarray(words), np.arange(1000, 1000 + len(words), dtype=np.int64)
            return
        words, ids = [], []
        seen: set[str] = set()
        for i in tokens.allowed_ids.tolist():
            w = tok.decode([i]).strip()
            if w in seen or not re.fullmatch(r"[A-Za-z][a-z]{0,11}[0-9]{0,4}", w):
                continue
            seen.add(w)
            if tok.encode(" " + w, add_special_tokens=False) == [i] and len(tok.encode(w, add_special_tokens=False)) == 1:
                words.append(w)
                ids.append(i)
                if len(words) >= _MAX_CANDIDATES:
                    break
        if len(words) < _MIN_POOL:
            raise DatasetError(f"the tokenizer has only {len(words)} one-token words (trace prompts need "
                               f"{_MIN_POOL}); pass another --tokenizer")
        sample = np.random.default_rng(0).integers(len(words), size=256)
        if tokens.count(" ".join(words[j] for j in sample)) != len(sample):
            raise DatasetError("the tokenizer merges words across spaces, so trace prompt lengths would not "
                               "be exact; pass another --tokenizer")
        self.words, self.ids = np.asarray(words), np.asarray(ids, dtype=np.int64)


_POOLS: dict[tuple[int, int], tuple[Any, WordPool]] = {}


def word_pool(tokens: TokenSource) -> WordPool:
    """The :class:`WordPool` of ``tokens``, built once per tokenizer and id range."""
    key = (id(tokens.tokenizer), int(tokens.allowed_ids.size))
    hit = _POOLS.get(key)
    if hit is None or hit[0] is not tokens.tokenizer:
        hit = _POOLS[key] = (tokens.tokenizer, WordPool(tokens))
    return hit[1]


def _key_seed(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little")


class TraceText:
    """Prompt content for a trace: stream ``key`` is an endless sequence of pool words fixed
    by ``(seed, key)``; its first ``n`` words are the same for every ``n`` (a shorter prompt
    of a stream is a prefix of a longer one). ``cache`` keeps the most recently used chunks
    of keys used again (blocks, sessions, system prompts); others are drawn again."""

    def __init__(self, pool: WordPool, seed: int):
        self.pool, self.seed = pool, seed
        self._chunks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    def _chunk(self, key: str, c: int, cache: bool) -> np.ndarray:
        got = self._chunks.get((key, c))
        if got is not None:
            self._chunks.move_to_end((key, c))
            return got
        rng = np.random.default_rng([self.seed, 11, _key_seed(key), c])
        got = rng.integers(len(self.pool.words), size=_CHUNK, dtype=np.int16)
        if cache:
            self._chunks[(key, c)] = got
            if len(self._chunks) > _CACHED_CHUNKS:
                self._chunks.popitem(last=False)
        return got

    def indices(self, key: str, n: int, cache: bool = True) -> np.ndarray:
        """Pool indices of the first ``n`` words of stream ``key``."""
        if n <= 0:
            return np.zeros(0, dtype=np.int16)
        parts = [self._chunk(key, c, cache) for c in range(-(-n // _CHUNK))]
        return np.concatenate(parts)[:n]

    def text(self, idx: np.ndarray) -> str:
        """The words of ``idx`` joined by spaces: exactly ``len(idx)`` tokens."""
        return " ".join(self.pool.words[idx].tolist())

    def ids(self, idx: np.ndarray) -> list[int]:
        """Token ids of ``idx`` (each the id of the word after a space)."""
        return self.pool.ids[idx].tolist()


# ---------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------


def _where(path: str, line: int) -> str:
    return f"--dataset-path {path}, line {line}"


def _value(d: dict, names: Sequence[str], kind: type, where: str, default: Any = _REQUIRED,
           minimum: float | None = None) -> Any:
    """``d``'s first present field of ``names`` as ``kind`` (int or float), at least
    ``minimum``; ``default`` when absent (absent and required: ``DatasetError``)."""
    v = next((d[n] for n in names if n in d and d[n] is not None and d[n] != ""), None)
    if v is None:
        if default is _REQUIRED:
            raise DatasetError(f"{where}: needs '{names[0]}'")
        return default
    what = "an integer" if kind is int else "a number"
    try:
        if isinstance(v, bool):
            raise ValueError
        f = float(v)
        if not np.isfinite(f) or (kind is int and f != int(f)):
            raise ValueError
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: '{names[0]}' must be {what}, got {v!r}") from None
    x = int(f) if kind is int else f
    if minimum is not None and x < minimum:
        raise DatasetError(f"{where}: '{names[0]}' must be >= {minimum:g}, got {v!r}")
    return x


def _jsonl(path: str) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{_where(path, lineno)}: invalid JSON: {e}") from None
            if not isinstance(d, dict):
                raise DatasetError(f"{_where(path, lineno)}: expected a JSON object")
            yield lineno, d


def _hash_ids(d: dict, where: str) -> list[int]:
    h = d.get("hash_ids") or []
    try:
        if not isinstance(h, list):
            raise TypeError
        return [int(x) for x in h]
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: 'hash_ids' must be a list of integers") from None


def _text(d: dict, name: str, where: str) -> str | None:
    v = d.get(name)
    if v is not None and not isinstance(v, str):
        raise DatasetError(f"{where}: '{name}' must be a string")
    return v


def _pagedllm_single(d: dict, scale: float, where: str, line: int) -> TraceRecord:
    ts = _value(d, ("timestamp", "arrival_time", "ts"), float, where) * scale
    out = _value(d, ("output_len", "output_length", "max_tokens"), int, where, minimum=1)
    prompt = _text(d, "prompt", where)
    plen = _value(d, ("prompt_len", "input_len", "input_length"), int, where, None, minimum=1)
    hash_ids = _hash_ids(d, where)
    if prompt is None and plen is None and not hash_ids:
        raise DatasetError(f"{where}: needs 'prompt' (text) or 'prompt_len'")
    sid = d.get("session_id")
    return TraceRecord(ts, out, line, prompt, plen, hash_ids, None if sid is None else str(sid))


def _pagedllm_turn(d: dict, scale: float, where: str, line: int) -> TraceRecord:
    if d.get("session_id") is None:
        raise DatasetError(f"{where}: a chat turn ('turn') needs 'session_id'")
    turn = _value(d, ("turn",), int, where, minimum=0)
    out = _value(d, ("output_len", "output_length", "max_tokens"), int, where, minimum=1)
    role = d.get("role", "user")
    if role not in ("user", "tool"):
        raise DatasetError(f"{where}: 'role' must be 'user' or 'tool', got {role!r}")
    message = _text(d, "message", where)
    mlen = _value(d, ("message_len",), int, where, None, minimum=1)
    if message is None and mlen is None:
        raise DatasetError(f"{where}: a chat turn needs 'message' (text) or 'message_len'")
    mid = d.get("message_id")
    rec = TraceRecord(None, out, line, message, mlen, session_id=str(d["session_id"]), turn=turn, role=role,
                      message_id=None if mid is None else str(mid),
                      abort_after_tokens=_value(d, ("abort_after_tokens",), int, where, None, minimum=1))
    if turn == 0:
        rec.arrival_s = _value(d, ("timestamp", "arrival_time", "ts"), float, where) * scale
        rec.system_prompt = _text(d, "system_prompt", where)
        rec.system_prompt_len = _value(d, ("system_prompt_len",), int, where, 0, minimum=0)
        rec.instruction_len = _value(d, ("instruction_len",), int, where, 0, minimum=0)
        uid = d.get("user_id")
        rec.user_id = str(uid) if uid is not None else rec.session_id
    else:
        rec.think_time_s = _value(d, ("think_time_s",), float, where, 0.0, minimum=0)
    return rec


def read_pagedllm(path: str, timestamp_unit: str = "s", limit: int | None = None) -> list[TraceRecord]:
    """Our JSONL (docs/traces.md): rows with ``turn`` are chat turns, others single requests
    (a file holds one kind). ``limit`` stops after that many single requests."""
    scale = 1e-3 if timestamp_unit == "ms" else 1.0
    recs: list[TraceRecord] = []
    for line, d in _jsonl(path):
        where = _where(path, line)
        chat = "turn" in d
        if recs and chat != (recs[0].turn is not None):
            raise DatasetError(f"{where}: chat turns (rows with 'turn') and single requests cannot be mixed")
        recs.append(_pagedllm_turn(d, scale, where, line) if chat else _pagedllm_single(d, scale, where, line))
        if limit is not None and not chat and len(recs) >= limit:
            break
    return recs


def read_mooncake(path: str, limit: int | None = None) -> list[TraceRecord]:
    """Mooncake's JSONL: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``."""
    recs: list[TraceRecord] = []
    for line, d in _jsonl(path):
        where = _where(path, line)
        recs.append(TraceRecord(_value(d, ("timestamp",), float, where) * 1e-3,
                                _value(d, ("output_length",), int, where, minimum=1), line,
                                prompt_len=_value(d, ("input_length",), int, where, minimum=1),
                                hash_ids=_hash_ids(d, where)))
        if limit is not None and len(recs) >= limit:
            break
    return recs


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d+))?\s*(Z|[+-]\d{2}:?\d{2})?")


def parse_azure_time(s: str) -> float:
    """Seconds since the epoch of an Azure trace ``TIMESTAMP`` ("2023-11-16 18:15:46.6805900",
    any number of fraction digits, optional "Z"/"+HH:MM"; UTC when none) or of a plain number
    of seconds. Raises ``ValueError``."""
    s = s.strip()
    m = _AZURE_TIME.fullmatch(s)
    if m is None:
        return float(s)
    y, mo, d, h, mi, sec = (int(x) for x in m.groups()[:6])
    tz = timezone.utc
    if m.group(8) and m.group(8) != "Z":
        off = m.group(8).replace(":", "")
        sign = -1 if off[0] == "-" else 1
        tz = timezone(sign * timedelta(hours=int(off[1:3]), minutes=int(off[3:5])))
    frac = float("0." + m.group(7)) if m.group(7) else 0.0
    return datetime(y, mo, d, h, mi, sec, tzinfo=tz).timestamp() + frac


def _read_csv(path: str, fmt: str, columns: dict[str, Sequence[str]], limit: int | None) -> tuple[list[TraceRecord], int]:
    """Rows of a CSV trace: ``columns`` maps time/prompt/output/session to accepted header names."""
    recs: list[TraceRecord] = []
    skipped = 0
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise DatasetError(f"--dataset-path {path}: empty {fmt} CSV")
        pos = {_norm(h): i for i, h in enumerate(header)}
        col = {what: next((pos[_norm(n)] for n in names if _norm(n) in pos), None) for what, names in columns.items()}
        missing = [names[0] for what, names in columns.items() if col[what] is None and what != "session"]
        if missing:
            raise DatasetError(f"--dataset-path {path}, line 1: a {fmt} CSV needs the columns "
                               f"{', '.join(names[0] for w, names in columns.items() if w != 'session')}; "
                               f"missing {', '.join(missing)} (header: {', '.join(header)})")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            where = _where(path, line)
            if len(row) < len(header):
                raise DatasetError(f"{where}: {len(row)} columns, the header has {len(header)}")
            cell = {columns[k][0]: row[i].strip() for k, i in col.items() if i is not None}
            time_col, prompt_col, output_col = (columns[k][0] for k in ("time", "prompt", "output"))
            if fmt == "azure":
                try:
                    ts = parse_azure_time(cell[time_col])
                except ValueError:
                    raise DatasetError(f"{where}: '{time_col}' must be a date-time like "
                                       f"2023-11-16 18:15:46.6805900, got {cell[time_col]!r}") from None
            else:
                ts = _value(cell, (time_col,), float, where)
            plen = _value(cell, (prompt_col,), int, where, minimum=0)
            out = _value(cell, (output_col,), int, where, minimum=0)
            if plen < 1 or out < 1:
                skipped += 1
                continue
            sid = cell.get(columns.get("session", ("",))[0]) or None
            recs.append(TraceRecord(ts, out, line, prompt_len=plen, session_id=sid))
            if limit is not None and len(recs) >= limit:
                break
    return recs, skipped


_AZURE_COLUMNS = {"time": ("TIMESTAMP",), "prompt": ("ContextTokens",), "output": ("GeneratedTokens",)}
_BURSTGPT_COLUMNS = {"time": ("Timestamp",), "prompt": ("Request tokens",), "output": ("Response tokens",),
                     "session": ("Session ID", "SessionID")}


def detect_format(path: str) -> str:
    """``path``'s trace format: a ``.csv`` (or a first line not starting with "{") by its
    header, Azure's or BurstGPT's; JSONL whose first row has ``input_length`` and
    ``hash_ids`` and none of our fields is Mooncake's, any other JSONL ours. Raises
    ``DatasetError`` for an empty file or a CSV header of neither."""
    first = ""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.lstrip().startswith("#"):
                first = line.strip()
                break
    if not first:
        raise DatasetError(f"--dataset-path: trace {path} has no rows")
    if path.lower().endswith(".csv") or not first.startswith("{"):
        names = {_norm(h) for h in next(csv.reader([first]), [])}
        for fmt, cols in (("azure", _AZURE_COLUMNS), ("burstgpt", _BURSTGPT_COLUMNS)):
            if all(any(_norm(n) in names for n in cols[k]) for k in ("time", "prompt", "output")):
                return fmt
        raise DatasetError(f"--dataset-path {path}: header {first[:120]!r} is neither Azure's (TIMESTAMP, "
                           f"ContextTokens, GeneratedTokens) nor BurstGPT's (Timestamp, Request tokens, "
                           f"Response tokens); pass --trace-format")
    try:
        d = json.loads(first)
    except json.JSONDecodeError:
        return "pagedllm"   # the reader names the line
    ours = ("prompt", "prompt_len", "session_id", "turn", "output_len")
    if isinstance(d, dict) and "input_length" in d and "hash_ids" in d and not any(k in d for k in ours):
        return "mooncake"
    return "pagedllm"


def read_trace(path: str, trace_format: str = "auto", timestamp_unit: str = "s",
               limit: int | None = None) -> tuple[str, list[TraceRecord], int]:
    """``(format, records, skipped_rows)`` of ``path`` in file order, times in absolute
    seconds. ``limit`` stops after that many single requests. Raises ``DatasetError``."""
    if trace_format not in TRACE_FORMATS:
        raise DatasetError(f"--trace-format must be one of {', '.join(TRACE_FORMATS)}, got {trace_format!r}")
    try:
        fmt = detect_format(path) if trace_format == "auto" else trace_format
        if fmt == "pagedllm":
            return fmt, read_pagedllm(path, timestamp_unit, limit), 0
        if fmt == "mooncake":
            return fmt, read_mooncake(path, limit), 0
        recs, skipped = _read_csv(path, fmt, _AZURE_COLUMNS if fmt == "azure" else _BURSTGPT_COLUMNS, limit)
        return fmt, recs, skipped
    except UnicodeDecodeError as e:
        raise DatasetError(f"--dataset-path {path}: not a text file ({e})") from None


# ---------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------


def _chat_sessions(path: str, recs: list[TraceRecord]) -> list[list[TraceRecord]]:
    """Chat turns grouped by session (turns in order), sessions in arrival order."""
    by_sid: dict[str, list[TraceRecord]] = {}
    for r in recs:
        by_sid.setdefault(r.session_id or "", []).append(r)
    sessions = []
    for sid, turns in by_sid.items():
        turns.sort(key=lambda r: r.turn or 0)
        for k, r in enumerate(turns):
            if r.turn != k:
                raise DatasetError(f"{_where(path, r.line)}: session {sid!r} has turn {r.turn} where turn {k} "
                                   f"belongs (turns are numbered 0, 1, ... once each)")
        sessions.append(turns)
    sessions.sort(key=lambda t: t[0].arrival_s or 0.0)
    return sessions


class TraceDataset(Dataset):
    """Replay of a trace file (module doc; default: the shipped agent trace). Single-request
    rows become one-turn completions sessions at their arrival; chat turns (our JSONL with
    ``turn``) become chat sessions whose later turns follow the previous reply after
    ``think_time_s``. ``limit`` takes the first N requests (chat: sessions).
    Raises ``DatasetError`` naming the flag or the line."""

    name = "trace"
    timed = True

    def __init__(self, tokens: TokenSource, path: str | None = None, speedup: float = 1.0,
                 timestamp_unit: str = "s", block_size: int = 512, trace_format: str = "auto",
                 limit: int | None = None):
        path = path or AGENT_TRACE_PATH
        if not os.path.isfile(path):
            raise DatasetError(f"--dataset-path: no such file: {path}")
        if not speedup > 0:
            raise DatasetError(f"--trace-speedup must be > 0, got {speedup}")
        if timestamp_unit not in ("s", "ms"):
            raise DatasetError(f"--trace-timestamp-unit must be 's' or 'ms', got {timestamp_unit!r}")
        if block_size < 1:
            raise DatasetError(f"--trace-block-size must be >= 1, got {block_size}")
        self.tokens, self.path, self.speedup = tokens, path, speedup
        self.timestamp_unit, self.block_size = timestamp_unit, block_size
        self.format, recs, self.skipped_rows = read_trace(path, trace_format, timestamp_unit, limit)
        if not recs:
            raise DatasetError(f"--dataset-path: trace {path} has no rows")
        self.chat = recs[0].turn is not None
        if self.chat:
            self.groups = _chat_sessions(path, recs)[:limit]
        else:
            self.groups = [[r] for r in sorted(recs, key=lambda r: r.arrival_s or 0.0)]
        t0 = self.groups[0][0].arrival_s or 0.0
        for g in self.groups:
            g[0].arrival_s = ((g[0].arrival_s or 0.0) - t0) / speedup
        self.rows = [r for g in self.groups for r in g]

    @property
    def kind(self) -> str:  # type: ignore[override]
        return "chat" if self.chat else "completions"

    def sessions(self, seed: int) -> Iterator[Session]:
        text = TraceText(word_pool(self.tokens), seed)
        for i, g in enumerate(self.groups):
            yield self._chat_session(text, g) if self.chat else self._single(text, i, g[0])

    def _single(self, text: TraceText, i: int, r: TraceRecord) -> Session:
        if r.prompt is not None:
            turn = TraceTurn(output_len=r.output_len, prompt=r.prompt, message=r.prompt,
                             prompt_len=self.tokens.count(r.prompt))
        else:
            n = r.prompt_len if r.prompt_len is not None else len(r.hash_ids) * self.block_size
            if r.hash_ids:
                blocks = [text.indices(f"block:{h}", self.block_size) for h in r.hash_ids]
                idx = np.concatenate(blocks)[:n]
                if len(idx) < n:
                    idx = np.concatenate([idx, text.indices(f"row:{i}", n - len(idx), cache=False)])
            elif r.session_id is not None:
                idx = text.indices(f"session:{r.session_id}", n)
            else:
                idx = text.indices(f"row:{i}", n, cache=False)
            turn = TraceTurn(output_len=r.output_len, prompt=text.ids(idx), prompt_len=n)
        sid = r.session_id if r.session_id is not None else f"t{i}"
        return Session(sid, [turn], arrival_s=r.arrival_s)

    def _chat_session(self, text: TraceText, g: list[TraceRecord]) -> Session:
        first = g[0]
        system = first.system_prompt
        if system is None:
            parts = [text.text(text.indices("system", first.system_prompt_len)),
                     text.text(text.indices(f"user:{first.user_id}", first.instruction_len))]
            system = " ".join(p for p in parts if p)
        turns = []
        for r in g:
            if r.prompt is not None:
                msg, n = r.prompt, self.tokens.count(r.prompt)
            else:
                n = int(r.prompt_len or 0)
                key = f"msg:{r.message_id}" if r.message_id is not None else f"turn:{r.session_id}:{r.turn}"
                msg = text.text(text.indices(key, n, cache=r.message_id is not None))
            turns.append(TraceTurn(output_len=r.output_len, message=msg, prompt_len=n,
                                   think_time_s=r.think_time_s if r.turn else 0.0, role=r.role,
                                   abort_after_tokens=r.abort_after_tokens))
        return Session(str(first.session_id), turns, kind="chat", system_prompt=system or None,
                       arrival_s=first.arrival_s)

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "format": self.format, "speedup": self.speedup,
                "num_rows": len(self.rows), "num_sessions": len(self.groups), "skipped_rows": self.skipped_rows,
                "timestamp_unit": self.timestamp_unit, "block_size": self.block_size,
                "span_s": self.groups[-1][0].arrival_s}

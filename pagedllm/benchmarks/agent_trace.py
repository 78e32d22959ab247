"""The synthetic agent trace shipped as ``data/agent_trace.jsonl`` (``bench serve --dataset
trace`` without ``--dataset-path`` replays it) and its generator, ``python -m
pagedllm.benchmarks.agent_trace --out FILE [--sessions N --seed S --reuse R ...]``: the same
arguments write the same bytes. Sessions share one system prompt, each user adds an
instruction; turns are user messages or tool results, with think times or tool waits
between them, re-asked questions and abandoned streams (``abort_after_tokens``). ``--reuse``
is the share of prompt tokens a perfect prefix cache would serve (:func:`prefix_reuse`);
the generator scales every message and tool-result length by one factor, found by
bisection, until the trace has it, and prints the share reached. Record fields and
parameters: docs/traces.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["AgentTraceParams", "generate", "prefix_reuse", "main"]


@dataclass
class AgentTraceParams:
    """Generator parameters. Lengths in tokens, ranges ``(lo, hi)`` drawn uniformly; times
    in seconds (think time and tool wait: log-normal, these medians, sigma 0.5); rates per
    second; probabilities per turn. ``reuse`` is the target share (0 < reuse < 1)."""

    sessions: int = 40
    seed: int = 0
    reuse: float = 0.86
    system_len: int = 3000
    users: int = 8
    instruction_len: tuple[int, int] = (50, 500)
    turns: tuple[int, int] = (3, 8)
    message_len: tuple[int, int] = (40, 400)
    tool_len: tuple[int, int] = (400, 2400)
    tool_prob: float = 0.6
    output_len: tuple[int, int] = (16, 200)
    session_rate: float = 0.5
    think_time: float = 3.0
    tool_wait: float = 0.5
    reask_prob: float = 0.1
    abort_prob: float = 0.08
    max_context: int = 7680

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first invalid parameter."""
        checks = [
            ("--sessions", self.sessions >= 1), ("--users", self.users >= 1),
            ("--reuse", 0 < self.reuse < 1), ("--system-len", self.system_len >= 0),
            ("--tool-prob", 0 <= self.tool_prob <= 1), ("--reask-prob", 0 <= self.reask_prob <= 1),
            ("--abort-prob", 0 <= self.abort_prob <= 1), ("--session-rate", self.session_rate > 0),
            ("--think-time", self.think_time >= 0), ("--tool-wait", self.tool_wait >= 0),
        ]
        for flag, lo in (("--instruction-len", 0), ("--turns", 1), ("--message-len", 1), ("--tool-len", 1),
                         ("--output-len", 1)):
            a, b = getattr(self, flag[2:].replace("-", "_"))
            checks.append((flag, lo <= a <= b))
        for flag, ok in checks:
            if not ok:
                raise ValueError(f"{flag}: invalid value (see --help)")
        need = self.system_len + self.instruction_len[1] + 1 + self.output_len[1]
        if self.max_context < need:
            raise ValueError(f"--max-context must be >= --system-len + max --instruction-len + 1 + max "
                             f"--output-len = {need}, got {self.max_context}")


# ---------------------------------------------------------------------------
# Prefix reuse of a chat trace, by content segments
# ---------------------------------------------------------------------------


def _segments(rec: dict, first: dict) -> tuple[list, list]:
    """(context before this turn's message, the message) as (key, tokens) segments."""
    head = []
    if first.get("system_prompt_len"):
        head.append(("system", first["system_prompt_len"]))
    if first.get("instruction_len"):
        head.append((f"user:{first.get('user_id', first['session_id'])}", first["instruction_len"]))
    key = rec.get("message_id")
    key = f"msg:{key}" if key is not None else f"turn:{rec['session_id']}:{rec['turn']}"
    return head, [(key, rec["message_len"])]


def prefix_reuse(records: Sequence[dict]) -> tuple[int, int]:
    """``(served, total)`` prompt tokens of a chat trace in our JSONL (lengths, not text):
    ``served`` is what a perfect prefix cache would serve, one of unlimited size and token
    granularity that holds every earlier prompt and its reply (``abort_after_tokens`` tokens
    when abandoned, else ``output_len``). Sessions go in arrival order, each whole. A content
    stream (the system prompt, a user's instruction, a ``message_id``) is the same tokens
    wherever it appears, so equal streams share a prefix of the shorter one's length."""
    sessions: dict[str, list[dict]] = {}
    for r in records:
        sessions.setdefault(str(r["session_id"]), []).append(r)
    order = sorted(sessions.values(), key=lambda t: min(t, key=lambda r: r["turn"]).get("timestamp", 0.0))
    root: dict = {}
    served = total = 0
    for turns in order:
        turns = sorted(turns, key=lambda r: r["turn"])
        history, _ = _segments(turns[0], turns[0])
        for r in turns:
            _, msg = _segments(r, turns[0])
            prompt = history + msg
            total += sum(n for _, n in prompt)
            served += _match(root, prompt)
            reply = r.get("abort_after_tokens") or r["output_len"]
            history = prompt + [(f"reply:{r['session_id']}:{r['turn']}", min(reply, r["output_len"]))]
            _insert(root, history)
    return served, total


def _match(node: dict, segs: list) -> int:
    n = 0
    for key, length in segs:
        by_len = node.get(key)
        if not by_len:
            return n
        if length not in by_len:
            return n + max(min(length, seen) for seen in by_len)
        n += length
        node = by_len[length]
    return n


def _insert(node: dict, segs: list) -> None:
    for key, length in segs:
        node = node.setdefault(key, {}).setdefault(length, {})


# ---------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------


def _draws(p: AgentTraceParams) -> dict[str, Any]:
    """Every random choice, drawn once, so that only the length scale varies in the search."""
    rng = np.random.default_rng([p.seed, 48])
    shape = (p.sessions, p.turns[1])
    return {
        "instr": rng.integers(p.instruction_len[0], p.instruction_len[1] + 1, size=p.users),
        "gaps": rng.exponential(1.0 / p.session_rate, size=p.sessions),
        "user": rng.integers(p.users, size=p.sessions),
        "nturns": rng.integers(p.turns[0], p.turns[1] + 1, size=p.sessions),
        "tool": rng.random(shape), "reask": rng.random(shape), "which": rng.random(shape),
        "len": rng.random(shape), "out": rng.integers(p.output_len[0], p.output_len[1] + 1, size=shape),
        "abort": rng.random(shape), "cut": rng.random(shape), "wait": rng.standard_normal(shape),
    }


def _build(p: AgentTraceParams, d: dict[str, Any], scale: float) -> list[dict]:
    """The trace's records with message and tool-result lengths scaled by ``scale``."""
    recs: list[dict] = []
    next_mid = 0
    t_arrive = 0.0
    for s in range(p.sessions):
        t_arrive = 0.0 if s == 0 else t_arrive + float(d["gaps"][s])
        user = int(d["user"][s])
        sid = f"s{s:03d}"
        instr = int(d["instr"][user])
        context = p.system_len + instr
        asked: list[tuple[int, int, int]] = []  # (turn, message_id, length) of user messages
        for t in range(int(d["nturns"][s])):
            role = "user" if t == 0 or d["tool"][s, t] >= p.tool_prob else "tool"
            out = int(d["out"][s, t])
            reask = None
            if role == "user" and asked and d["reask"][s, t] < p.reask_prob:
                reask, mid, mlen = asked[min(int(d["which"][s, t] * len(asked)), len(asked) - 1)]
            else:
                lo, hi = p.message_len if role == "user" else p.tool_len
                mlen = max(1, int(round((lo + d["len"][s, t] * (hi - lo)) * scale)))
                mid = None
            if t == 0:
                mlen = min(mlen, p.max_context - context - out)
            if context + mlen + out > p.max_context:
                break
            if mid is None:
                mid, next_mid = next_mid, next_mid + 1
                if role == "user":
                    asked.append((t, mid, mlen))
            r: dict[str, Any] = {"session_id": sid, "turn": t}
            if t == 0:
                r.update(timestamp=round(t_arrive, 3), user_id=f"u{user:02d}", system_prompt_len=p.system_len,
                         instruction_len=instr)
            else:
                median = p.tool_wait if role == "tool" else p.think_time
                r["think_time_s"] = round(median * math.exp(0.5 * float(d["wait"][s, t])), 3)
            r.update(role=role, message_id=mid, message_len=mlen, output_len=out)
            reply = out
            if out >= 2 and d["abort"][s, t] < p.abort_prob:
                reply = 1 + int(d["cut"][s, t] * (out - 1))
                r["abort_after_tokens"] = reply
            if reask is not None:
                r["reask_of"] = reask
            recs.append(r)
            context += mlen + reply
    return recs


def _share(recs: list[dict]) -> float:
    served, total = prefix_reuse(recs)
    return served / total if total else 0.0


def generate(p: AgentTraceParams) -> tuple[list[dict], dict]:
    """``(records, stats)`` for ``p``: the length scale in [0.01, 100] whose trace's reuse is
    nearest ``p.reuse`` (bisection on the log scale; reuse falls as messages grow). Stats:
    ``reuse`` reached, ``scale``, ``requests``, ``prompt_tokens``, counts of ``tool_turns``,
    ``reasked`` and ``abandoned``. Raises ``ValueError`` when ``p.reuse`` is out of reach."""
    p.validate()
    d = _draws(p)
    lo, hi = math.log(0.01), math.log(100.0)
    r_lo, r_hi = _share(_build(p, d, math.exp(lo))), _share(_build(p, d, math.exp(hi)))
    if not r_hi <= p.reuse <= r_lo:
        raise ValueError(f"--reuse {p.reuse} is out of reach with these parameters (from {r_hi:.3f} to "
                         f"{r_lo:.3f}); change --system-len, --turns or --sessions")
    best = (abs(r_lo - p.reuse), lo)
    for _ in range(40):
        mid = (lo + hi) / 2
        r = _share(_build(p, d, math.exp(mid)))
        best = min(best, (abs(r - p.reuse), mid))
        lo, hi = (mid, hi) if r > p.reuse else (lo, mid)
    scale = math.exp(best[1])
    recs = _build(p, d, scale)
    served, total = prefix_reuse(recs)
    stats = {"reuse": served / total, "scale": scale, "sessions": p.sessions, "requests": len(recs),
             "prompt_tokens": total, "served_tokens": served,
             "tool_turns": sum(r["role"] == "tool" for r in recs),
             "reasked": sum("reask_of" in r for r in recs),
             "abandoned": sum("abort_after_tokens" in r for r in recs)}
    return recs, stats


def write_trace(path: str, p: AgentTraceParams, recs: list[dict], stats: dict) -> None:
    """Write ``recs`` as JSONL after a ``#`` line with the parameters and the reuse reached."""
    head = {"generator": "python -m pagedllm.benchmarks.agent_trace", "params": asdict(p),
            "reuse": round(stats["reuse"], 4), "scale": round(stats["scale"], 4)}
    with open(path, "w", encoding="utf-8") as f:
        f.write("# " + json.dumps(head, separators=(",", ":")) + "\n")
        for r in recs:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")


def _range(v: str) -> tuple[int, int]:
    """Argparse type: ``N`` or ``LO,HI`` (integers)."""
    parts = v.split(",")
    try:
        if len(parts) > 2:
            raise ValueError
        return int(parts[0]), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO,HI, got {v!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The generator's command line; returns the exit status."""
    d = AgentTraceParams()
    ap = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.agent_trace",
                                 description="Write a synthetic agent trace (our JSONL) for bench serve --dataset trace.")
    ap.add_argument("--out", required=True, help="output JSONL file")
    ap.add_argument("--sessions", type=int, default=d.sessions, help="sessions in the trace")
    ap.add_argument("--seed", type=int, default=d.seed, help="random seed (same seed, same file)")
    ap.add_argument("--reuse", type=float, default=d.reuse,
                    help="share of prompt tokens a perfect prefix cache would serve (0-1)")
    ap.add_argument("--system-len", type=int, default=d.system_len, help="tokens of the shared system prompt")
    ap.add_argument("--users", type=int, default=d.users, help="distinct users (each with one instruction)")
    ap.add_argument("--instruction-len", type=_range, default=d.instruction_len,
                    help="LO,HI tokens of a user's instruction, appended to the system prompt")
    ap.add_argument("--turns", type=_range, default=d.turns, help="LO,HI requests per session")
    ap.add_argument("--message-len", type=_range, default=d.message_len,
                    help="LO,HI tokens of a new user message, before the reuse scale")
    ap.add_argument("--tool-len", type=_range, default=d.tool_len,
                    help="LO,HI tokens of a tool result, before the reuse scale")
    ap.add_argument("--tool-prob", type=float, default=d.tool_prob, help="chance a later turn is a tool result")
    ap.add_argument("--output-len", type=_range, default=d.output_len, help="LO,HI max tokens per reply")
    ap.add_argument("--session-rate", type=float, default=d.session_rate, help="session arrivals per second (Poisson)")
    ap.add_argument("--think-time", type=float, default=d.think_time,
                    help="median seconds before a user turn (log-normal, sigma 0.5)")
    ap.add_argument("--tool-wait", type=float, default=d.tool_wait,
                    help="median seconds a tool takes before its result turn (log-normal, sigma 0.5)")
    ap.add_argument("--reask-prob", type=float, default=d.reask_prob,
                    help="chance a later user turn repeats an earlier user message of its session")
    ap.add_argument("--abort-prob", type=float, default=d.abort_prob,
                    help="chance a turn's stream is abandoned (abort_after_tokens)")
    ap.add_argument("--max-context", type=int, default=d.max_context,
                    help="a session ends before a turn whose prompt + max tokens would pass this")
    args = ap.parse_args(argv)
    p = AgentTraceParams(**{k: getattr(args, k) for k in asdict(d)})
    try:
        recs, stats = generate(p)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_trace(args.out, p, recs, stats)
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes): {stats['sessions']} sessions, "
          f"{stats['requests']} requests, {stats['prompt_tokens']} prompt tokens; prefix reuse "
          f"{stats['reuse']:.4f} (target {p.reuse}) at length scale {stats['scale']:.3f}; "
          f"{stats['tool_turns']} tool results, {stats['reasked']} re-asked, {stats['abandoned']} abandoned")
    return 0


if __name__ == "__main__":
    sys.exit(main())

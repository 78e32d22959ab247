"""Argparse types for integer flags of the bench commands: each parses one value or raises
``argparse.ArgumentTypeError`` with the reason (argparse then names the flag)."""
from __future__ import annotations

import argparse


def _int_at_least(v: str, lo: int) -> int:
    try:
        i = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {v!r}") from None
    if i < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    return i


def positive_int(v: str) -> int:
    """An integer >= 1."""
    return _int_at_least(v, 1)


def non_negative_int(v: str) -> int:
    """An integer >= 0."""
    return _int_at_least(v, 0)

"""Incremental JSON syntax checking, one character at a time (RFC 8259; syntax only, and
NaN / Infinity refused), so a streaming parser can forward a value's text as it arrives
and still see a syntax error at the character where it happens."""
from __future__ import annotations

from enum import Enum

WHITESPACE = " \t\n\r"
_HEX = "0123456789abcdefABCDEF"
_ESCAPES = '"\\/bfnrt'
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class Scan(Enum):
    """What one character did to the value being scanned."""

    MORE = 0      # consumed; the value is not complete yet
    DONE = 1      # consumed; it completed the value
    ENDED = 2     # not consumed: the value (a number) was already complete before it
    ERROR = 3     # not consumed: no JSON value continues this way


# Number states: the characters seen so far, and whether the number may end there.
_NUMBER_NEXT = {
    "sign": {"0": "zero", **{d: "int" for d in "123456789"}},
    "zero": {".": "dot", "e": "exp", "E": "exp"},
    "int": {**{d: "int" for d in "0123456789"}, ".": "dot", "e": "exp", "E": "exp"},
    "dot": {d: "frac" for d in "0123456789"},
    "frac": {**{d: "frac" for d in "0123456789"}, "e": "exp", "E": "exp"},
    "exp": {"+": "exp_sign", "-": "exp_sign", **{d: "exp_digits" for d in "0123456789"}},
    "exp_sign": {d: "exp_digits" for d in "0123456789"},
    "exp_digits": {d: "exp_digits" for d in "0123456789"},
}
_NUMBER_MAY_END = {"zero", "int", "frac", "exp_digits"}


class JsonValueScanner:
    """Checks the syntax of one JSON value fed character by character; leading whitespace is
    skipped. Must not be fed after DONE, ENDED or ERROR.

    Attributes:
        first_char: the value's first character once seen, else None.
    """

    def __init__(self):
        self._stack: list[str] = []   # open containers, "{" or "["
        self._state = "value"
        self._number = ""             # number DFA state
        self._literal = ""            # rest of the literal still expected
        self._hex_left = 0
        self._key = False             # the string being scanned is an object key
        self.first_char: str | None = None

    def feed(self, c: str) -> Scan:
        """Take one character ``c`` (a str of length 1)."""
        st = self._state
        if st == "string":
            if c == '"':
                return self._end_value()
            if c == "\\":
                self._state = "escape"
            elif ord(c) < 0x20:
                return Scan.ERROR
            return Scan.MORE
        if st == "escape":
            if c == "u":
                self._state, self._hex_left = "hex", 4
            elif c in _ESCAPES:
                self._state = "string"
            else:
                return Scan.ERROR
            return Scan.MORE
        if st == "hex":
            if c not in _HEX:
                return Scan.ERROR
            self._hex_left -= 1
            if not self._hex_left:
                self._state = "string"
            return Scan.MORE
        if st == "number":
            nxt = _NUMBER_NEXT[self._number].get(c)
            if nxt is not None:
                self._number = nxt
                return Scan.MORE
            if self._number not in _NUMBER_MAY_END:
                return Scan.ERROR
            if not self._stack:
                self._state = "finished"
                return Scan.ENDED
            self._state = "after"          # the number ended; c belongs to its container
            return self.feed(c)
        if st == "literal":
            if c != self._literal[0]:
                return Scan.ERROR
            self._literal = self._literal[1:]
            return self._end_value() if not self._literal else Scan.MORE
        if c in WHITESPACE and st != "finished":
            return Scan.MORE
        if st == "value" or (st == "array_first" and c != "]"):
            return self._start_value(c)
        if st in ("object_first", "key") and c == '"':
            self._state, self._key = "string", True
            return Scan.MORE
        if st == "colon" and c == ":":
            self._state = "value"
            return Scan.MORE
        if st in ("after", "object_first", "array_first"):
            top = self._stack[-1]
            if st == "after" and c == ",":
                self._state = "key" if top == "{" else "value"
                return Scan.MORE
            if c == ("}" if top == "{" else "]"):
                self._stack.pop()
                return self._end_value()
        return Scan.ERROR

    def _start_value(self, c: str) -> Scan:
        if self.first_char is None:
            self.first_char = c
        if c in "{[":
            self._stack.append(c)
            self._state = "object_first" if c == "{" else "array_first"
        elif c == '"':
            self._state, self._key = "string", False
        elif c == "-" or c.isascii() and c.isdigit():
            self._state, self._number = "number", ("sign" if c == "-" else "zero" if c == "0" else "int")
        elif c in _LITERALS:
            self._state, self._literal = "literal", _LITERALS[c][1:]
        else:
            return Scan.ERROR
        return Scan.MORE

    def _end_value(self) -> Scan:
        if self._state == "string" and self._key:
            self._key = False
            self._state = "colon"
            return Scan.MORE
        if not self._stack:
            self._state = "finished"
            return Scan.DONE
        self._state = "after"
        return Scan.MORE

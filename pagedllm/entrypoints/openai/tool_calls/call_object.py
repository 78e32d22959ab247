"""Reading one call object, ``{"name": ..., "arguments": {...}}`` (Llama 3 writes
``"parameters"``), one character at a time, as the Hermes and Llama 3 JSON formats write
it: the name once known, the arguments' raw text as it arrives, and the character where
the object goes wrong."""
from __future__ import annotations

import json
from enum import Enum

from pagedllm.entrypoints.openai.tool_calls.json_scan import WHITESPACE, JsonValueScanner, Scan

ARGUMENT_KEYS = ("arguments", "parameters")


class Read(Enum):
    """What one character did to the call object."""

    MORE = 0    # consumed; the object is not closed yet
    DONE = 1    # consumed; it closed a well-formed call object
    ERROR = 2   # not consumed: the object is malformed from this character on


class CallObjectReader:
    """Follows one call object (leading whitespace allowed): a JSON object with a non-empty
    ``"name"`` string and at most one of ``"arguments"`` / ``"parameters"`` (an object; absent
    means ``{}``); other keys are ignored; a key may not repeat.

    Attributes:
        name: the decoded function name once its string is closed, else None.
        arguments_text: the raw arguments text received so far (grows only).
        arguments_complete: the arguments object is closed.
        error: why the object is malformed (after a feed returned ERROR), else None.
    """

    def __init__(self):
        self.name: str | None = None
        self.arguments_text = ""
        self.arguments_complete = False
        self.error: str | None = None
        self._state = "open"
        self._scanner: JsonValueScanner | None = None
        self._raw = ""          # raw text of the key or value being scanned
        self._key: str | None = None
        self._seen: set[str] = set()

    @property
    def arguments(self) -> str:
        """The arguments JSON of a closed object (``"{}"`` when it had none)."""
        return self.arguments_text if self.arguments_text else "{}"

    def feed(self, c: str) -> Read:
        """Take one character ``c``."""
        st = self._state
        if st in ("key", "value"):
            return self._feed_scanner(c)
        if c in WHITESPACE:
            return Read.MORE
        if st == "open":
            return self._go("first") if c == "{" else self._fail("a call must be a JSON object")
        if st in ("first", "key_start") and c == '"':
            self._scanner, self._raw, self._state = JsonValueScanner(), "", "key"
            return self._feed_scanner(c)
        if st == "colon" and c == ":":
            return self._go("value_start")
        if st == "value_start":
            self._scanner, self._raw, self._state = JsonValueScanner(), "", "value"
            if self._key in ARGUMENT_KEYS and c != "{":
                return self._fail(f'"{self._key}" must be a JSON object')
            return self._feed_scanner(c)
        if st == "after" and c == ",":
            return self._go("key_start")
        if st in ("after", "first") and c == "}":
            if self.name is None:
                return self._fail('the call has no "name"')
            self._state = "done"
            return Read.DONE
        return self._fail(f"unexpected {c!r} in the call object")

    def _go(self, state: str) -> Read:
        self._state = state
        return Read.MORE

    def _fail(self, why: str) -> Read:
        self.error = why
        self._state = "error"
        return Read.ERROR

    def _feed_scanner(self, c: str) -> Read:
        r = self._scanner.feed(c)
        if r is Scan.ERROR:
            return self._fail("the call object is not valid JSON")
        if r is not Scan.ENDED:
            self._raw += c
            if self._state == "value" and self._key in ARGUMENT_KEYS:
                self.arguments_text += c
        if r is Scan.MORE:
            return Read.MORE
        if self._state == "key":
            key = json.loads(self._raw)
            if key in self._seen or (key in ARGUMENT_KEYS and self._seen & set(ARGUMENT_KEYS)):
                return self._fail(f"the call object repeats {key!r}")
            self._seen.add(key)
            self._key = key
            return self._go("colon")
        # a value is complete
        if self._key == "name":
            name = json.loads(self._raw)
            if not isinstance(name, str) or not name:
                return self._fail('"name" must be a non-empty string')
            self.name = name
        elif self._key in ARGUMENT_KEYS:
            self.arguments_complete = True
        self._state = "after"
        return self.feed(c) if r is Scan.ENDED else Read.MORE

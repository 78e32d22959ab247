"""The XGrammar backend (Dong et al. 2024; https://github.com/mlc-ai/xgrammar): constraint
keys, parse-only validation, the compiler and the per-request matcher."""
from __future__ import annotations

import functools
import json
import re

from pagedllm.errors import InvalidParameterError
from pagedllm.sampling_params import StructuredOutputsParams

# "[10:48:33] /project/cpp/regex_converter.cc:94: " before xgrammar's own message
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_key(params: StructuredOutputsParams) -> tuple[str, str]:
    """The compile-cache key of a constraint: (kind, spec string). Kinds: ``"json"`` (the
    schema, ``json.dumps`` order kept), ``"json_any"``, ``"regex"``, ``"grammar"`` (EBNF; a
    choice becomes ``root ::= "a" | "b"``); JSON kinds get ``"!ws"`` for ``disable_any_whitespace``."""
    kind = params.kind
    ws = "!ws" if params.disable_any_whitespace else ""
    if kind == "json":
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        return "json" + ws, spec
    if kind == "json_object":
        return "json_any" + ws, ""
    if kind == "regex":
        return "regex", params.regex
    if kind == "choice":
        # JSON string escapes are EBNF string escapes (", \\, \n, \uXXXX)
        return "grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
    return "grammar", params.grammar


def parse_grammar(kind: str, spec: str):
    """An ``xgr.Grammar`` for a ``grammar_key``: parsing only, no tokenizer.

    Raises:
        RuntimeError / ValueError / TypeError: a bad spec."""
    import xgrammar as xgr

    base, _, ws = kind.partition("!")
    if base == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=not ws)
    if base == "json_any":
        if not ws:
            return xgr.Grammar.builtin_json_grammar()
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if base == "regex":
        return xgr.Grammar.from_regex(spec)
    if base == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    raise ValueError(f"unknown grammar kind {kind!r}")


@functools.lru_cache(maxsize=256)
def _parse_error(kind: str, spec: str) -> str | None:
    """xgrammar's parse error for a key, cleaned of its C++ location; None when it parses."""
    if kind.startswith("json"):
        try:
            schema = json.loads(spec) if kind.startswith("json!") or kind == "json" else None
        except ValueError as e:
            return f"json is not valid JSON: {e}"
        if schema is not None and not isinstance(schema, (dict, bool)):
            return f"json schema must be an object or a boolean, got {type(schema).__name__}"
    try:
        parse_grammar(kind, spec)
    except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError, ValueError, ...)
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _CPP_PREFIX.sub("", msg)
    return None


def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Check that a constraint parses, without compiling it (cached by spec).

    Raises:
        InvalidParameterError("structured_outputs"): it does not parse (quoting xgrammar)."""
    kind, spec = grammar_key(params)
    err = _parse_error(kind, spec)
    if err is not None:
        raise InvalidParameterError("structured_outputs", f"structured_outputs.{params.kind} is invalid: {err}")


class XgrammarBackend:
    """The tokenizer's vocabulary as xgrammar sees it, and a compiler over it. ``vocab_size``:
    the model's logits width (ids past the tokenizer never allowed); ``stop_token_ids``:
    allowed once a grammar is complete; ``max_threads``: compile threads per grammar."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    def compile(self, kind: str, spec: str):
        """An ``xgr.CompiledGrammar`` for a ``grammar_key`` (slow: run off the engine loop).

        Raises:
            RuntimeError / ValueError: the spec does not compile."""
        return self.compiler.compile_grammar(parse_grammar(kind, spec))


class StructuredOutputGrammar:
    """One request's ``xgr.GrammarMatcher`` over ``compiled``; engine core thread only."""

    def __init__(self, compiled):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_processed_tokens = 0

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance through ``tokens``; False at the first rejected one (earlier ones stay accepted)."""
        for t in tokens:
            if not self.matcher.accept_token(int(t)):
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar accepts from here; the matcher is unchanged."""
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return list(tokens[:n])

    def rollback(self, n: int) -> None:
        if n > 0:
            self.matcher.rollback(n)
            self.num_processed_tokens -= n

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (int32 CPU [rows, ceil(V / 32)])."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

"""Structured outputs: grammar-constrained decoding with XGrammar (Dong et al. 2024,
"XGrammar: Flexible and Efficient Structured Generation Engine for Large Language
Models"), vLLM V1's ``StructuredOutputManager`` design in our own small code.

- ``backend.py``: the xgrammar backend: a request's constraint as a (kind, spec) key,
  its cheap validation (parse only), the compiler, and the per-request matcher.
- ``manager.py``: the engine core's owner of grammars: compiles off the engine loop with a
  cache, builds each step's allowed-token bitmask (k + 1 rows for k drafts), advances
  matchers with accepted tokens.
- ``bitmask.py``: the runner's side: a bitmask as it crosses the seam, and applying it to
  logits.
"""
from pagedllm.structured_output.backend import grammar_key, validate_structured_outputs
from pagedllm.structured_output.bitmask import apply_token_bitmask, unpack_bitmask
from pagedllm.structured_output.manager import GrammarCompileError, StructuredOutputManager

__all__ = ["GrammarCompileError", "StructuredOutputManager", "apply_token_bitmask", "grammar_key",
           "unpack_bitmask", "validate_structured_outputs"]

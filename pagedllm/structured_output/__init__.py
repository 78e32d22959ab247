"""Structured outputs: grammar-constrained decoding with XGrammar (Dong et al. 2024), after
vLLM V1's ``StructuredOutputManager``. Design: docs/notes/structured-output.md."""
from pagedllm.structured_output.backend import grammar_key, validate_structured_outputs
from pagedllm.structured_output.bitmask import apply_token_bitmask, unpack_bitmask
from pagedllm.structured_output.manager import GrammarCompileError, StructuredOutputManager

__all__ = ["GrammarCompileError", "StructuredOutputManager", "apply_token_bitmask", "grammar_key",
           "unpack_bitmask", "validate_structured_outputs"]

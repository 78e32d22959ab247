"""StructuredOutputManager: the engine core's owner of grammars (vLLM V1's design): compiles
in a thread pool with a (kind, spec) cache, builds each step's bitmask (k + 1 rows for k
drafts), advances matchers with accepted tokens. Flow: docs/notes/structured-output.md."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections import OrderedDict

from pagedllm.messages import GrammarBitmask
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import StructuredOutputGrammar, XgrammarBackend, grammar_key
from pagedllm.structured_output.bitmask import pack_bitmask

logger = logging.getLogger("pagedllm")


class GrammarCompileError(RuntimeError):
    """A request's grammar failed to compile."""


class StructuredOutputManager:
    """Args: ``model_path`` (tokenizer source); ``vocab_size`` (logits width);
    ``model_eos_token_ids``; ``max_workers`` (compile threads); ``cache_size`` (LRU of
    compiled grammars). ``num_compiles`` counts compiles actually run."""

    def __init__(self, model_path: str, vocab_size: int, model_eos_token_ids: list[int],
                 max_workers: int = 1, cache_size: int = 256):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.model_eos_token_ids = list(model_eos_token_ids)
        self.cache_size = cache_size
        self.num_compiles = 0
        self._executor: cf.ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._pending: dict[str, cf.Future] = {}
        self._grammars: dict[str, StructuredOutputGrammar] = {}

    # -- compiling -------------------------------------------------------------------
    def _get_backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                from pagedllm.tokenizer import eos_token_ids, get_tokenizer

                tok = get_tokenizer(self.model_path)
                stop = eos_token_ids(tok, self.model_eos_token_ids, self.model_path)
                self._backend = XgrammarBackend(tok, self.vocab_size, sorted(stop))
            return self._backend

    def _compile(self, kind: str, spec: str):
        backend = self._get_backend()
        self.num_compiles += 1
        return backend.compile(kind, spec)

    def add_request(self, req_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling ``req_id``'s grammar (or reuse a cached compile)."""
        key = grammar_key(params)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            if self._executor is None:
                self._executor = cf.ThreadPoolExecutor(self._max_workers, thread_name_prefix="pagedllm-grammar")
            fut = self._cache[key] = self._executor.submit(self._compile, *key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        self._pending[req_id] = fut

    def is_ready(self, req_id: str) -> bool:
        """True once ``req_id``'s grammar is compiled and its matcher made.

        Raises:
            GrammarCompileError: the compile failed."""
        if req_id in self._grammars:
            return True
        fut = self._pending[req_id]
        if not fut.done():
            return False
        del self._pending[req_id]
        err = fut.exception()
        if err is not None:
            raise GrammarCompileError(f"structured_outputs: grammar failed to compile: {err}") from err
        self._grammars[req_id] = StructuredOutputGrammar(fut.result())
        return True

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compile finishes or ``timeout`` seconds pass."""
        pending = [f for f in self._pending.values() if not f.done()]
        if pending:
            cf.wait(pending, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    @property
    def num_compiling(self) -> int:
        return sum(not f.done() for f in self._pending.values())

    # -- per step --------------------------------------------------------------------
    def validate_drafts(self, req_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` the request's grammar accepts next."""
        return self._grammars[req_id].validate_tokens(drafts)

    def grammar_bitmask(self, scheduled: list[tuple[str, list[int]]]) -> GrammarBitmask | None:
        """This step's bitmask for ``scheduled`` (req_id, validated drafts) in schedule order:
        len(drafts) + 1 rows per request (row j: allowed after j drafts); None if empty."""
        if not scheduled:
            return None
        import xgrammar as xgr

        num_rows = sum(len(d) + 1 for _, d in scheduled)
        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)   # all allowed
        first_row: dict[str, int] = {}
        row = 0
        for rid, drafts in scheduled:
            g = self._grammars[rid]
            first_row[rid] = row
            advanced = 0
            for j in range(len(drafts) + 1):
                if not g.is_terminated():
                    g.fill_bitmask(bitmask, row + j)
                if j < len(drafts) and not g.is_terminated() and advanced == j:
                    advanced += g.accept_tokens([drafts[j]])   # a rejected draft: later rows keep this state
            g.rollback(advanced)
            row += len(drafts) + 1
        return pack_bitmask(bitmask, first_row)

    def accept_tokens(self, req_id: str, tokens: list[int]) -> bool:
        """Advance ``req_id``'s matcher over its produced tokens; False at the first rejected one."""
        return self._grammars[req_id].accept_tokens(tokens)

    def is_terminated(self, req_id: str) -> bool:
        return self._grammars[req_id].is_terminated()

    def remove_request(self, req_id: str) -> None:
        """Forget a finished or aborted request (a running compile goes on for the cache)."""
        self._pending.pop(req_id, None)
        self._grammars.pop(req_id, None)

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

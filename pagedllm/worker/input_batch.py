"""The runner's persistent input batch (vLLM V1's ``InputBatch``): one row per running
request in preallocated numpy arrays, changed by each ``SchedulerOutput``'s deltas, so a
step's inputs are gathers, not Python lists rebuilt."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


class CachedRequestState:
    """A request's state while out of the batch, to rebuild its row; ``generator`` (seeded
    requests) carries on across preemption."""

    __slots__ = ("req_id", "num_prompt_tokens", "token_ids", "sampling_params", "eos_token_ids",
                 "block_ids", "num_computed_tokens", "generator")

    def __init__(self, req_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int], block_ids: list[list[int]], num_computed_tokens: int,
                 generator: torch.Generator | None):
        self.req_id = req_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.block_ids = [list(g) for g in block_ids]   # one table per KV-cache group
        self.num_computed_tokens = num_computed_tokens
        self.generator = generator


class InputBatch:
    """Rows of requests in preallocated arrays (R = ``max_num_reqs``, G = KV-cache groups).

    Arrays: ``token_ids`` int32 [R, max_model_len]; ``num_tokens``, ``num_prompt_tokens``,
    ``num_computed_tokens`` int64 [R]; ``block_tables`` int32 [G, R, max_num_blocks_per_req]
    (``block_table`` = group 0's), ``num_blocks`` int32 [R]; sampling floats float32 [R],
    ``top_k``/``min_tokens``/``num_logprobs``/``num_prompt_logprobs`` int64 [R] (-1 = off).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 num_kv_cache_groups: int = 1):
        R = max_num_reqs
        self.token_ids = np.zeros((R, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(R, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(R, dtype=np.int64)
        self.num_computed_tokens = np.zeros(R, dtype=np.int64)
        self.block_tables = np.zeros((num_kv_cache_groups, R, max_num_blocks_per_req), dtype=np.int32)
        self.block_table = self.block_tables[0]
        self.num_blocks = np.zeros(R, dtype=np.int32)
        self.temperature = np.zeros(R, dtype=np.float32)
        self.top_p = np.ones(R, dtype=np.float32)
        self.min_p = np.zeros(R, dtype=np.float32)
        self.top_k = np.zeros(R, dtype=np.int64)
        self.min_tokens = np.zeros(R, dtype=np.int64)
        self.presence_penalty = np.zeros(R, dtype=np.float32)
        self.frequency_penalty = np.zeros(R, dtype=np.float32)
        self.repetition_penalty = np.ones(R, dtype=np.float32)
        self.num_logprobs = np.full(R, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(R, -1, dtype=np.int64)
        self.allowed_ids: dict[int, np.ndarray] = {}
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.bad_words: dict[int, list[list[int]]] = {}
        self.generators: dict[int, torch.Generator] = {}
        self.stop_ids: dict[int, list[int]] = {}
        self.row_of: dict[str, int] = {}
        self.req_id_of: list[str | None] = [None] * R
        self._free_rows = list(range(R - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def add(self, st: CachedRequestState) -> int:
        """Give ``st`` a row, filled from its state; returns the row.

        Raises:
            RuntimeError: every row is taken (more running requests than max_num_seqs).
        """
        if not self._free_rows:
            raise RuntimeError("input batch is full: more running requests than max_num_seqs")
        row = self._free_rows.pop()
        self.row_of[st.req_id] = row
        self.req_id_of[row] = st.req_id
        n = len(st.token_ids)
        self.token_ids[row, :n] = st.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = st.num_prompt_tokens
        self.num_computed_tokens[row] = st.num_computed_tokens
        self.set_block_ids(row, st.block_ids)
        sp = st.sampling_params
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        self.top_k[row] = sp.top_k
        self.min_tokens[row] = sp.min_tokens
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[row] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        if sp.allowed_token_ids:
            self.allowed_ids[row] = np.asarray(sorted(set(sp.allowed_token_ids)), dtype=np.int64)
        if sp.logit_bias:
            self.logit_bias[row] = (np.fromiter(sp.logit_bias.keys(), dtype=np.int64),
                                    np.fromiter(sp.logit_bias.values(), dtype=np.float32))
        if sp.bad_words_token_ids:
            self.bad_words[row] = sp.bad_words_token_ids
        if st.generator is not None:
            self.generators[row] = st.generator
        if sp.min_tokens > 0:
            banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(st.eos_token_ids))
            self.stop_ids[row] = sorted(banned)
        return row

    def remove(self, req_id: str, st: CachedRequestState | None = None) -> None:
        """Free ``req_id``'s row, saving tokens and blocks into ``st`` if given."""
        row = self.row_of.pop(req_id)
        if st is not None:
            st.token_ids = self.token_ids[row, : self.num_tokens[row]].tolist()
            st.block_ids = self.block_tables[:, row, : self.num_blocks[row]].tolist()
        self.req_id_of[row] = None
        self.generators.pop(row, None)
        self.stop_ids.pop(row, None)
        self.allowed_ids.pop(row, None)
        self.logit_bias.pop(row, None)
        self.bad_words.pop(row, None)
        self.presence_penalty[row] = self.frequency_penalty[row] = 0.0
        self.repetition_penalty[row] = 1.0
        self.num_logprobs[row] = self.num_prompt_logprobs[row] = -1
        self._free_rows.append(row)

    def set_block_ids(self, row: int, block_ids: list[list[int]]) -> None:
        """Replace a row's block tables (one equal-length list per group)."""
        for g, ids in enumerate(block_ids):
            self.block_tables[g, row, : len(ids)] = ids
        self.num_blocks[row] = len(block_ids[0])

    def append_block_ids(self, row: int, block_ids: list[list[int]]) -> None:
        """Append to a row's block tables (one equal-length list per group)."""
        k = len(block_ids[0])
        if k:
            n = self.num_blocks[row]
            for g, ids in enumerate(block_ids):
                self.block_tables[g, row, n: n + k] = ids
            self.num_blocks[row] = n + k

    def append_tokens(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Append one token to each of ``rows`` (int64 [N]); ``tokens`` int [N]."""
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1

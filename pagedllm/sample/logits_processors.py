"""Request-dependent logit edits before temperature and sampling, vectorised over one step's
logit rows, in this order (tests/sample/test_logits_processors.py): 1. token masks
(``allowed_token_ids``, ``bad_words``, grammar bitmask); 2. the ``min_tokens`` ban of
EOS/stop ids, then ``logit_bias``; 3. repetition penalty (Keskar et al. 2019, CTRL), then
frequency and presence (OpenAI's formula). Notes: docs/notes/sample.md."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu import load_cpu_kernels


@dataclass
class LogitsProcessorInputs:
    """What steps 1-3 need for N logit rows (each field None when unused): ``allowed`` (row
    int64 [A], mask bool [A, V]); ``banned`` (row, token int64 [M]) set to -inf; ``bias``
    (row, token int64 [K], float32 [K]); ``penalty_rows`` int64 [P] with ``seen`` from
    ``token_presence`` and ``repetition`` / ``frequency`` / ``presence`` float32 [P]."""

    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalty_rows: torch.Tensor | None = None
    seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None


def apply_token_masks(logits: torch.Tensor, inp: LogitsProcessorInputs) -> None:
    """Step 1 without the grammar: -inf outside ``allowed``. In place on float logits [N, V]."""
    if inp.allowed is not None:
        rows, mask = inp.allowed
        sub = logits.index_select(0, rows)
        logits.index_copy_(0, rows, sub.masked_fill(~mask, float("-inf")))


def apply_ban_and_bias(logits: torch.Tensor, inp: LogitsProcessorInputs) -> None:
    """Step 2: the banned pairs to -inf, then the logit biases added. In place."""
    if inp.banned is not None:
        logits[inp.banned] = float("-inf")
    if inp.bias is not None:
        rows, toks, vals = inp.bias
        logits.index_put_((rows, toks), vals.to(logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, inp: LogitsProcessorInputs) -> None:
    """Step 3: repetition, then frequency and presence penalties, on the seen pairs only. In place."""
    if inp.penalty_rows is None or inp.seen is None:
        return
    r, c, n = inp.seen
    if r.numel() == 0:
        return
    lr = inp.penalty_rows[r]
    x = logits[lr, c].float()
    rep = inp.repetition[r]
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - inp.frequency[r] * n - inp.presence[r] * (n > 0).float()
    logits[lr, c] = x.to(logits.dtype)


def token_presence(history: torch.Tensor, prompt_len: torch.Tensor, length: torch.Tensor,
                   vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens P sequences have seen, as sparse pairs (never [P, V]); the C++ kernel on the CPU.
    ``history`` int64 [P, L] (prompt then output, padded past ``length``); ``prompt_len``,
    ``length`` int64 [P]. Returns (row int64 [M], token int64 [M], output count float32 [M]),
    sorted by row then token."""
    if history.device.type == "cpu":
        ops = load_cpu_kernels()
        if ops is not None:
            rows, toks, counts = ops.token_presence(history.to(torch.int64), prompt_len, length, vocab_size)
            return rows, toks, counts
    return token_presence_torch(history, prompt_len, length, vocab_size)


def token_presence_torch(history: torch.Tensor, prompt_len: torch.Tensor, length: torch.Tensor,
                         vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_presence`` in torch ops: the non-CPU fallback and the kernel's test reference."""
    pos = torch.arange(history.shape[1], device=history.device).unsqueeze(0)
    valid = pos < length.unsqueeze(1)
    in_output = (pos >= prompt_len.unsqueeze(1)) & valid
    rows = torch.arange(history.shape[0], device=history.device).unsqueeze(1)
    keys = (rows * vocab_size + history)[valid]
    uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
    counts = torch.zeros(uniq.shape[0], device=history.device).scatter_add_(0, inv, in_output[valid].float())
    return uniq // vocab_size, uniq % vocab_size, counts


class RawLogitsSave:
    """Saves the values ``process_logits`` will overwrite in ``rows`` (int64 [R]) of float
    ``logits`` [N, V], so ``restore`` puts them back after sampling; ``grammar``: whether a
    bitmask will apply."""

    def __init__(self, logits: torch.Tensor, inp: LogitsProcessorInputs, rows: torch.Tensor,
                 grammar: bool) -> None:
        want = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        want[rows] = True
        dense = torch.zeros_like(want)
        if grammar:
            dense = want.clone()
        elif inp.allowed is not None:
            dense[inp.allowed[0]] = True
            dense &= want
        self.dense_rows = torch.nonzero(dense).squeeze(1)
        self.dense_vals = logits.index_select(0, self.dense_rows) if len(self.dense_rows) else None
        pairs_r, pairs_t = [], []
        if inp.banned is not None:
            pairs_r.append(inp.banned[0])
            pairs_t.append(inp.banned[1])
        if inp.bias is not None:
            pairs_r.append(inp.bias[0])
            pairs_t.append(inp.bias[1])
        if inp.penalty_rows is not None and inp.seen is not None:
            pairs_r.append(inp.penalty_rows[inp.seen[0]])
            pairs_t.append(inp.seen[1])
        self.sparse = None
        if pairs_r:
            r, t = torch.cat(pairs_r), torch.cat(pairs_t)
            keep = want[r] & ~dense[r]
            r, t = r[keep], t[keep]
            if r.numel():
                self.sparse = (r, t, logits[r, t])

    def restore(self, logits: torch.Tensor) -> None:
        if self.sparse is not None:
            r, t, v = self.sparse
            logits[r, t] = v
        if self.dense_vals is not None:
            logits.index_copy_(0, self.dense_rows, self.dense_vals)


def process_logits(logits: torch.Tensor, inp: LogitsProcessorInputs, grammar=None) -> None:
    """Steps 1-3 in place on float logits [N, V]; ``grammar``: callable applying the bitmask, or None."""
    apply_token_masks(logits, inp)
    if grammar is not None:
        grammar(logits)
    apply_ban_and_bias(logits, inp)
    apply_penalties(logits, inp)

"""The request-dependent edits of the logits before temperature and sampling, vectorised
over the logit rows of one step (a row per sampled position: one per plain request,
k + 1 per request verifying k drafts).

Order (after the raw logprobs are taken, before temperature; documented in README.md's
"Sampling" section and tested in tests/sample/test_logits_processors.py):

1. token masks: ``allowed_token_ids``, ``bad_words`` and the grammar bitmask of
   structured outputs (all are -inf masks, so their order among themselves is moot);
2. the ``min_tokens`` ban of EOS and stop token ids, then ``logit_bias`` (added);
3. penalties: repetition (prompt and output tokens; Keskar et al. 2019, CTRL: a positive
   logit is divided by the penalty, a negative one multiplied), then frequency and
   presence (output tokens only; OpenAI's formula
   ``logit - frequency_penalty * count - presence_penalty * (count > 0)``).

Temperature, min-p, top-k/top-p and the draw follow in ``Sampler`` / ``RejectionSampler``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.kernels.cpu import load_cpu_kernels


@dataclass
class LogitsProcessorInputs:
    """What step 1-3 need for N logit rows; every field None when no row uses it.

    Attributes:
        allowed: (row index int64 [A], allowed-token mask bool [A, V]) for rows with
            ``allowed_token_ids``.
        banned: (row int64 [M], token int64 [M]) pairs masked to -inf: bad words whose
            prefix the row's output ends with, and EOS/stop ids before ``min_tokens``.
        bias: (row int64 [K], token int64 [K], bias float32 [K]) from ``logit_bias``.
        penalty_rows: int64 [P], the rows with a penalty; ``seen`` the (penalty row
            int64 [M], token int64 [M], times generated float32 [M]) of every token seen
            in those rows' prompts or outputs (``token_presence``); ``repetition`` /
            ``frequency`` / ``presence`` float32 [P].
    """

    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalty_rows: torch.Tensor | None = None
    seen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    repetition: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    presence: torch.Tensor | None = None


def apply_token_masks(logits: torch.Tensor, inp: LogitsProcessorInputs) -> None:
    """Step 1 without the grammar (the runner applies its bitmask right after): -inf
    outside ``allowed`` and at the bad-word pairs of ``banned``. In place on float
    logits [N, V]."""
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
    """Step 3: repetition, then frequency and presence penalties. In place.

    Only the (row, token) pairs whose token was seen (in the prompt or the output) change,
    so they are gathered, penalised and written back: a few hundred per row instead of
    the whole [P, V]; the values are the same as the dense formula's, bit for bit."""
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
    """The tokens P sequences have seen, and how often each was generated, as sparse
    pairs (O(P * L) work and memory, never [P, V]).

    Args:
        history: int64 [P, L], each row's tokens (prompt, then output), padded past
            ``length`` with any valid id.
        prompt_len / length: int64 [P], prompt tokens and tokens before the position
            being sampled (so drafts before a draft position count as output).
        vocab_size: V.

    Returns:
        (row int64 [M], token int64 [M], output count float32 [M]): each (row, token)
        seen in the row's prompt or output once, sorted by row then token; the count is
        its occurrences in the output (0 for a prompt-only token).

    On the CPU with the C++ kernels built, their ``token_presence`` computes the same
    three tensors row by row (a table of the vocabulary's counts per thread instead of a
    ``torch.unique`` sort over every row's tokens: ~0.05 against 0.5 ms for 32 x 330).
    """
    if history.device.type == "cpu":
        ops = load_cpu_kernels()
        if ops is not None:
            rows, toks, counts = ops.token_presence(history.to(torch.int64), prompt_len, length, vocab_size)
            return rows, toks, counts
    return token_presence_torch(history, prompt_len, length, vocab_size)


def token_presence_torch(history: torch.Tensor, prompt_len: torch.Tensor, length: torch.Tensor,
                         vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_presence`` in torch ops (a ``torch.unique`` over row * V + token): the path
    off the CPU or without the C++ kernels, and the reference of the kernel's tests."""
    pos = torch.arange(history.shape[1], device=history.device).unsqueeze(0)
    valid = pos < length.unsqueeze(1)
    in_output = (pos >= prompt_len.unsqueeze(1)) & valid
    rows = torch.arange(history.shape[0], device=history.device).unsqueeze(1)
    keys = (rows * vocab_size + history)[valid]
    uniq, inv = torch.unique(keys, sorted=True, return_inverse=True)
    counts = torch.zeros(uniq.shape[0], device=history.device).scatter_add_(0, inv, in_output[valid].float())
    return uniq // vocab_size, uniq % vocab_size, counts


class RawLogitsSave:
    """The values ``process_logits`` will overwrite in some rows of the logits, taken
    before it runs, so that ``restore`` gives those rows back their raw values after
    sampling (the logprobs read the raw distribution). Sparse edits (banned pairs, logit
    biases, penalised seen tokens) save just their (row, token) values; a row with a dense
    mask (``allowed_token_ids``, or any row when a grammar bitmask will apply) saves the
    whole row.

    Args:
        logits: float [N, V], not yet processed.
        inp: the step's ``LogitsProcessorInputs``.
        rows: int64 [R], the logit rows to give back.
        grammar: whether a grammar bitmask will apply to ``logits``.
    """

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
        """Write the saved raw values back into ``logits``, in place."""
        if self.sparse is not None:
            r, t, v = self.sparse
            logits[r, t] = v
        if self.dense_vals is not None:
            logits.index_copy_(0, self.dense_rows, self.dense_vals)


def process_logits(logits: torch.Tensor, inp: LogitsProcessorInputs, grammar=None) -> None:
    """Steps 1-3 in order, in place on float logits [N, V]; ``grammar``: a callable that
    masks ``logits`` in place with the structured-output bitmask (or None)."""
    apply_token_masks(logits, inp)
    if grammar is not None:
        grammar(logits)
    apply_ban_and_bias(logits, inp)
    apply_penalties(logits, inp)

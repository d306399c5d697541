"""Logits processors that depend on a request's tokens: min_tokens, logit_bias and the three penalties.

Called by `Sampler` once per step on the rows that asked for any of them, before temperature and
truncation; the chosen token's logprobs stay those of the raw logits (as vLLM v1 reports them). The
order and formulas are vLLM v1's, so a client moving between the two gets the same distribution:

1. min_tokens: while a row has fewer than `min_tokens` output tokens, its stop tokens (the request's
   EOS ids, kept under `ignore_eos` as vLLM keeps them, and `stop_token_ids`) get -inf.
2. logit_bias: `logits[t] += bias[t]`.
3. repetition_penalty r (tokens seen in the prompt or the output so far):
   `logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r`.
4. frequency_penalty f and presence_penalty p (output tokens only):
   `logits[t] -= f * count_out[t] + p * (count_out[t] > 0)`.

A row's tokens are read from the request itself every step (stateless: no count can go stale across
preemption, a PD hand-off or a recompute); the prompt's distinct ids are computed once per request
(`TokenHistory.prompt_unique_ids`), as a 50k-token prompt would otherwise cost a scan per step. The
penalties change only the logits of tokens a row has seen, so they gather and scatter those
(O(distinct tokens) per row, not O(vocabulary)).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from pdserve.sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the processors read of a row's request (`engine.request.Request` is one)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    prompt_unique_ids: np.ndarray | None  # cache: sorted distinct prompt ids, filled here on first use
    grammar: object | None  # structured outputs (model/grammar.RequestGrammar), masked by the Sampler


def needs_history(p: SamplingParams) -> bool:
    """Whether a row's logits depend on its tokens (or its bias): the rows `apply` must see."""
    return bool(
        p.min_tokens
        or p.logit_bias
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
    )


def _prompt_ids(h: TokenHistory) -> np.ndarray:
    if h.prompt_unique_ids is None:
        h.prompt_unique_ids = np.unique(np.asarray(h.prompt_token_ids, dtype=np.int64))
    return h.prompt_unique_ids


def _counts(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct ids and how often each occurs (sorted; a sort and a diff, cheaper than np.unique's
    hashing for the few hundred ids of an output)."""
    a = np.sort(np.asarray(ids, dtype=np.int64))
    if not len(a):
        return a, a
    starts = np.flatnonzero(np.diff(a, prepend=a[0] - 1))
    return a[starts], np.diff(starts, append=len(a))


def _seen_ids(h: TokenHistory) -> np.ndarray:
    """Distinct ids of the prompt and the output: the cached prompt set plus the output ids not in it
    (a binary search per output id, not a union of the whole prompt set every step)."""
    prompt = _prompt_ids(h)
    out = _counts(h.output_token_ids)[0]
    if not len(prompt):
        return out
    pos = np.minimum(np.searchsorted(prompt, out), len(prompt) - 1)
    return np.concatenate((prompt, out[prompt[pos] != out]))


def _pairs(rows: list[int], id_arrays: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id of every row, as two int64 tensors on `device`."""
    row_idx = np.repeat(np.asarray(rows, dtype=np.int64), [len(a) for a in id_arrays])
    tok_idx = np.concatenate(id_arrays) if id_arrays else np.empty(0, dtype=np.int64)
    return torch.from_numpy(row_idx).to(device), torch.from_numpy(tok_idx.astype(np.int64)).to(device)


def apply(logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory]) -> torch.Tensor:
    """Process `logits` [N, V] (float32) in place and return it; rows whose params need nothing are
    left alone (the sampler takes the raw logprobs it reports before calling this).

    The bias's ids were checked against the vocabulary when the request was built
    (`LLMEngine.make_request`); prompt and output ids are below V by construction."""
    rows = [i for i, p in enumerate(params) if needs_history(p)]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]

    # 1-2. Additive: -inf for a short row's stop tokens, then the bias (one scatter each, all rows).
    ban_rows, ban_ids, bias_rows, bias_ids, bias_vals = [], [], [], [], []
    for i in rows:
        p, h = params[i], histories[i]
        if len(h.output_token_ids) < p.min_tokens:
            stops = {t for t in (*h.eos_token_ids, *p.stop_token_ids) if t < vocab}  # (others never occur)
            ban_rows += [i] * len(stops)
            ban_ids += sorted(stops)
        for tok, bias in p.logit_bias.items():
            bias_rows.append(i)
            bias_ids.append(tok)
            bias_vals.append(bias)
    if ban_rows:
        logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device)] = float("-inf")
    if bias_rows:
        idx = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
        logits.index_put_(idx, torch.tensor(bias_vals, device=device, dtype=logits.dtype), accumulate=True)

    # 3-4. Penalties touch only the tokens a row has seen: gather those logits, change them, put them
    # back (O(distinct tokens per row), where a dense [rows, V] pass costs ~10 full-vocabulary ops).
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:
        seen = [_seen_ids(histories[i]) for i in rep_rows]
        r_idx, t_idx = _pairs(rep_rows, seen, device)
        r = torch.tensor([params[i].repetition_penalty for i in rep_rows], dtype=logits.dtype)
        r = r.repeat_interleave(torch.tensor([len(a) for a in seen])).to(device)
        vals = logits[r_idx, t_idx]
        # A tiny r (found by the HTTP fuzzing: 5e-324) is 0 in float32, making -inf * r NaN, and sends
        # positive logits to +inf, softmax to NaN: r is kept >= the smallest normal float, the
        # quotient <= the largest. A huge one (1e39) is inf in float32, and a seen token's logit 0
        # times it NaN, which greedy picked (a review, 2026-12-04): r <= the largest float too.
        finfo = torch.finfo(logits.dtype)
        r = r.clamp(min=finfo.tiny, max=finfo.max)
        divided = (vals / r).clamp_(max=finfo.max)
        logits[r_idx, t_idx] = torch.where(vals > 0, divided, vals * r)  # (-inf, a ban, stays -inf)
    out_rows = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    if out_rows:
        uniq = [_counts(histories[i].output_token_ids) for i in out_rows]
        r_idx, t_idx = _pairs(out_rows, [u for u, _ in uniq], device)
        counts = np.concatenate([c for _, c in uniq]) if uniq else np.empty(0)
        lengths = torch.tensor([len(u) for u, _ in uniq])
        f = torch.tensor(
            [params[i].frequency_penalty for i in out_rows], dtype=logits.dtype
        ).repeat_interleave(lengths)
        p = torch.tensor(
            [params[i].presence_penalty for i in out_rows], dtype=logits.dtype
        ).repeat_interleave(lengths)
        penalty = f * torch.from_numpy(counts.astype(np.float32)).to(logits.dtype) + p
        logits[r_idx, t_idx] -= penalty.to(device)
    return logits

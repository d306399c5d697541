"""Token sampling for one step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Rows whose request has a grammar (structured outputs) get the tokens it forbids masked to -inf first
(`model/grammar.py`), then rows that ask for min_tokens, logit_bias or a penalty go through
`logits_processors.apply` (greedy rows take the argmax of the processed logits). Logprobs are those of
the model's distribution before any processing, temperature and truncation, as vLLM v1 reports them
by default — after the grammar's mask, which vLLM v1 also applies to the logits its sampler receives.

Sampling uses the exponential race (argmax of p / q, q ~ Exp(1)), which draws exactly from p and
lets a seeded request draw its noise from its own generator, so its output does not depend on what
else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model import grammar, logits_processors
from pdserve.model.logits_processors import TokenHistory
from pdserve.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0


@dataclass
class SampleResult:
    token_ids: list[int]
    # (chosen token's logprob, top-n [(id, logprob)], chosen token's rank) per row; None: not asked.
    # Rank: 1 + how many tokens are likelier, a tie ranking with the token (vLLM's count of >=).
    logprobs: list[tuple[float, list[tuple[int, float]], int] | None]


class Sampler:
    def __init__(self, device: str, seed: int) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.device = device

    def new_generator(self, seed: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,  # [N, V] float32; rows with a grammar or logits processors: changed in place
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[TokenHistory] | None = None,  # per row (their grammar, tokens for processors)
    ) -> SampleResult:
        n = logits.shape[0]
        if histories is not None:
            rows = [i for i, h in enumerate(histories) if getattr(h, "grammar", None) and h.grammar.active]
            if rows:
                grammar.mask_logits(logits, rows, [histories[i].grammar for i in rows])  # (in place)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Of the raw logits (after a grammar's mask). A masked token's -inf is reported as -9999.0, as
        # vLLM's API does: JSON has no infinity.
        lp = torch.log_softmax(logits[want], dim=-1).clamp_(min=LOGPROB_FLOOR) if want else None
        if any(logits_processors.needs_history(p) for p in params):
            if histories is None:
                raise ValueError("min_tokens, logit_bias and penalties need the rows' token histories")
            logits_processors.apply(logits, params, histories)  # (in place)
        chosen = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = _truncated_probs(logits[rows], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=generators[i] or self.generator)
            chosen[rows] = (probs / noise).argmax(dim=-1)
        token_ids = chosen.tolist()
        logprobs: list = [None] * n
        if lp is not None:
            max_top = max(params[i].logprobs for i in want)
            top_vals, top_ids = lp.topk(max_top, dim=-1) if max_top else (None, None)
            chosen_col = lp.gather(1, chosen[want][:, None])  # [len(want), 1]
            ranks = (lp >= chosen_col).sum(dim=1).tolist()
            chosen_lp = chosen_col.squeeze(1).tolist()
            for j, i in enumerate(want):
                k = params[i].logprobs
                top = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True)) if k else []
                logprobs[i] = (chosen_lp[j], top, ranks[j])
        return SampleResult(token_ids, logprobs)


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, min-p, then top-k and top-p: vLLM v1's order (min-p is an
    argmax-invariant logits processor applied before its top-k/top-p sampler). [N, V].

    Each filter touches only the rows that asked for it, so a row's distribution never depends on its
    neighbours in the batch (seeded sampling stays batch-independent, bit for bit). Top-k keeps every
    token tied with the k-th logit, as vLLM does."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    # (a temperature finite for SamplingParams, 1e39, is inf in float32, and -inf / inf (a banned token)
    # NaN: the whole row's draw was token 0, a token the request may forbid; a review, 2026-12-04)
    logits = logits / temps.clamp(max=torch.finfo(logits.dtype).max)[:, None]
    vocab = logits.shape[-1]
    if any(p.min_p > 0 for p in params):
        # Drop tokens less likely than min_p x the most likely one (min_p = 0: nothing is below 0).
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=logits.dtype)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if any(p.top_k or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1)  # ascending: the k-th largest sits at vocab - k
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in params], device=logits.device)
        kth = sorted_logits.gather(1, (vocab - top_k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        # Drop the least likely tokens while their mass stays within 1 - top_p (the most likely token
        # always stays); rows with top_p = 1 are left alone (float32 sums may pass 1.0 slightly).
        mass = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = (mass <= (1 - top_p)[:, None]) & (top_p < 1.0)[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)

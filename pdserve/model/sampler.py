"""Token sampling for one step: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Logprobs are those of the model's raw distribution (log_softmax of the logits before temperature
and truncation), as vLLM reports them by default.

Sampling uses the exponential race (argmax of p / q, q ~ Exp(1)), which draws exactly from p and
lets a seeded request draw its noise from its own generator, so its output does not depend on what
else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]  # (chosen, top-n) per row


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
        logits: torch.Tensor,  # [N, V] float32
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> SampleResult:
        n = logits.shape[0]
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
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            max_top = max(params[i].logprobs for i in want)
            top_vals, top_ids = lp.topk(max_top, dim=-1) if max_top else (None, None)
            chosen_lp = lp.gather(1, chosen[want][:, None]).squeeze(1).tolist()
            for j, i in enumerate(want):
                k = params[i].logprobs
                top = list(zip(top_ids[j, :k].tolist(), top_vals[j, :k].tolist(), strict=True)) if k else []
                logprobs[i] = (chosen_lp[j], top)
        return SampleResult(token_ids, logprobs)


def _truncated_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (rows renormalised). [N, V]."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    if any(p.top_k or p.top_p < 1.0 for p in params):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        top_k = torch.tensor([min(p.top_k, vocab) or vocab for p in params], device=logits.device)
        drop = ranks >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device, dtype=logits.dtype)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device, dtype=probs.dtype)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs

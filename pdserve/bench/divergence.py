"""Greedy outputs that differ between two runs of the same agents: where, and whether at a near-tie.

Who calls it: `pdserve bench dualpath` (and so `make demo`) when the policies' greedy outputs differ.
Placement changes where KV is read and how requests are batched, never the tokens — up to float
rounding: another chunking, batch or read path sums in another order and moves a logit by ~1e-6, which
flips an argmax only where the top two logprobs are that close. Such a flip changes that agent's every
later turn (its next prompts carry it). Each agent's first differing token is looked up on a colocated
engine: a difference at a near-tie (top-two gap under NEAR_TIE_LOGPROB, both tokens among the top two)
is rounding; any other is a real mismatch (wrong KV, a bug).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.bench.agentic import AgentPlan, turn_prompts

NEAR_TIE_LOGPROB = 1e-4  # top-two logprob gap below which a flipped greedy token is rounding


@dataclass(frozen=True)
class Divergence:
    """An agent's first greedy token that differs between run A and run B."""

    agent: int
    turn: int
    token_index: int  # in that turn's output
    token_a: int
    token_b: int
    prompt_ids: tuple[int, ...]  # what preceded it: the turn's prompt (run A's history) + A's output so far
    gap: float | None = None  # colocated top-two logprob gap there (None: not judged)
    near_tie: bool | None = None

    def summary(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "prompt_ids"}


def first_divergences(
    agents: list[AgentPlan], a: dict[int, list[list[int]]], b: dict[int, list[list[int]]]
) -> list[Divergence]:
    """Each agent's first differing output token (turns both runs completed; a turn that is a prefix
    of the other's, e.g. one run stopped at EOS, counts as the token after it: -1 for none)."""
    out = []
    for plan in agents:
        outs_a, outs_b = a.get(plan.agent, []), b.get(plan.agent, [])
        for t, (x, y) in enumerate(zip(outs_a, outs_b, strict=False)):
            if x == y:
                continue
            i = next((j for j in range(min(len(x), len(y))) if x[j] != y[j]), min(len(x), len(y)))
            prompt = turn_prompts(plan, outs_a[:t])[t] + x[:i]
            tok_a, tok_b = (x[i] if i < len(x) else -1), (y[i] if i < len(y) else -1)
            out.append(Divergence(plan.agent, t, i, tok_a, tok_b, tuple(prompt)))
            break
    return out


def judge(llm, div: Divergence) -> Divergence:
    """`div` with the colocated engine's (`llm`, a `pdserve.LLM`) top-two gap at its prompt."""
    from pdserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2)
    step = llm.generate({"prompt_token_ids": list(div.prompt_ids)}, params)[0].outputs[0].logprobs[0]
    (first, lp_first), (second, lp_second) = step.top[0], step.top[1]
    gap = lp_first - lp_second
    near = gap < NEAR_TIE_LOGPROB and {div.token_a, div.token_b} == {first, second}
    return Divergence(**{**asdict(div), "prompt_ids": div.prompt_ids, "gap": gap, "near_tie": near})

"""Offline batch API, shaped like vLLM's `LLM`.

from pdserve import LLM, SamplingParams
llm = LLM(model="path/to/hf-dir", page_size=16, dtype="float32")
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].num_cached_tokens
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        """kwargs are those of `EngineConfig.create` (page_size, dtype, device, num_pages, ...)."""
        self.engine = LLMEngine(EngineConfig.create(model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Serve all prompts together (continuous batching); outputs come back in input order.

        Every prompt is validated before any is queued, so one bad prompt leaves the engine untouched.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        ids: list[str] = []
        try:
            for prompt, tok, p in zip(prompts, tokenized, params, strict=True):
                ids.append(self.engine.add_request(prompt, p, tokenized=tok))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in ids]

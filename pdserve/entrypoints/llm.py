"""Offline batch API, shaped like vLLM's `LLM`.

from pdserve import LLM, SamplingParams
llm = LLM(model="path/to/hf-dir", page_size=16, dtype="float32")
outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=32))
outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].num_cached_tokens
SamplingParams(n=4, seed=0): four choices per prompt in `outputs` (index 0..3), each its own request
on the engine (choice j seeded seed + j), sharing the prompt's pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import MEMORY_TAGS, LLMEngine
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams, child_seed


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        """kwargs are those of `EngineConfig.create` (page_size, dtype, device, num_pages, ...)."""
        self.engine = LLMEngine(EngineConfig.create(model, **kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def sleep(self, level: int = 1) -> None:
        """vLLM's: give the engine's memory back between rollouts (its KV buffers; its weights too, kept
        in host memory at level 1, freed at level 2 and loaded again from the checkpoint on wake_up).
        `generate` raises EngineAsleep until `wake_up`."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, not {level}")
        self.engine.release_memory(MEMORY_TAGS, keep_weights_on_host=level == 1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: bring back what `sleep` gave back (`tags`: "weights", "kv_cache"; default both)."""
        self.engine.resume_memory(tuple(tags) if tags else MEMORY_TAGS)

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Serve all prompts together (continuous batching); outputs come back in input order, one per
        prompt, its `n` choices in `outputs`.

        A prompt that fails validation aborts those queued before it, so one bad prompt leaves the
        engine untouched.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, Sequence) or not all(isinstance(p, str | dict) for p in prompts):
            # (a bare list of ids read as ids of prompts; an int was "'int' object is not iterable")
            raise ValueError(
                "prompts: a string, a {'prompt': str} or {'prompt_token_ids': [int, ...]} dict, or a "
                "list of those (a list of token ids goes in a dict)"
            )
        prompts = list(prompts)
        if sampling_params is None:  # (the model's generation-config values, as vLLM's offline API)
            sampling_params = SamplingParams(**dict(self.engine.config.model_config.sampling_defaults))
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params]
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params: a SamplingParams or a list of them (one per prompt)")
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        tokenized = [self.engine.tokenize_prompt(p) for p in prompts]
        groups: list[tuple[str | None, list[str]]] = []  # per prompt: (the id naming its n choices, ids)
        ids: list[str] = []
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=sum(p.n for p in params), disable=not use_tqdm, desc="generate")
        try:
            for prompt, tok, p in zip(prompts, tokenized, params, strict=True):
                # (a max_tokens past the context ends there, "length", as vLLM's offline API does)
                base = self.engine.new_request_id() if p.n > 1 else None
                for j in range(p.n):
                    choice = p if base is None else replace(p, n=1, seed=child_seed(p.seed, j))
                    rid = None if base is None else f"{base}_{j}"
                    ids.append(self.engine.add_request(prompt, choice, rid, tok, cap_max_tokens=True))
                groups.append((base, ids[-p.n :]))
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        except BaseException:
            # (a bad prompt, an error in a step, or Ctrl-C: what was queued, left holding pages, ran
            # first, whole, in the caller's next generate)
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        return [
            done[group[0]] if base is None else _choices(base, [done[r] for r in group])
            for base, group in groups
        ]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered as the server's chat route renders them (`Tokenizer.chat_prompt`), then
        generated."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs its template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
                raise ValueError("messages: a list of {'role', 'content'} dicts, or a list of such lists")
            _, ids = tokenizer.chat_prompt(conversation, add_generation_prompt, tools, chat_template_kwargs)
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)


def _choices(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n choices (requests `<id>_<j>`) as one output: choice j at `outputs[j]`; the
    prompt's fields from the first (all share the prompt); times from the earliest to the latest."""
    times: dict = {}
    for key, pick in (("arrival_time", min), ("first_token_time", min), ("last_token_time", max)):
        values = [o.metrics[key] for o in outs if o.metrics.get(key) is not None]
        times[key] = pick(values) if values else None
    outputs = [replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    return replace(outs[0], request_id=request_id, outputs=outputs, metrics=outs[0].metrics | times)

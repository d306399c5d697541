"""`LLMEngine`: validation, tokenization, the step loop and output processing (stops, text).

Single-threaded: the offline `LLM` calls `step()` directly; the server runs it in one engine thread
(`pdserve.engine.async_engine`). One step = schedule -> run the model -> append sampled tokens ->
check stops -> publish full pages to the prefix cache -> release finished requests' pages.

Length (~650 lines): the engine's request path end to end — validation, the step loop, stops and
text, outputs, weight updates, memory released and resumed — shares one request object and one
scheduler; the parts that stand
alone (scheduler, KV managers, model runner, sampler, detokenizer) are their own modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

from pdserve.config import ConfigError, EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestStatus, TokenLogprob
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.hashing import root_key
from pdserve.kvcache.kv_manager import KVManager
from pdserve.model import loader
from pdserve.model.grammar import GrammarBackend, InvalidGrammar
from pdserve.model.loader import CheckpointError
from pdserve.outputs import CompletionOutput, GrowingPrefix, RequestOutput
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer, TokenizerError


class InvalidRequest(ValueError):
    """The request cannot be served as given (too long, empty, bad values). No state was changed."""


class DuplicateRequestId(InvalidRequest):
    """Another request with this id is active (a conflict: HTTP 409, not a bad request)."""


class EngineBusy(InvalidRequest):
    """The operation needs an idle engine and requests are in flight."""


class WeightsLost(RuntimeError):
    """A weight update failed midway and the previous weights could not be restored."""


class EngineAsleep(RuntimeError):
    """The engine gave its memory back (`release_memory`): no request runs until `resume_memory`."""


MEMORY_TAGS = ("kv_cache", "weights")  # what `release_memory` may give back (SGLang's and vLLM's tags)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        try:
            self.tokenizer: Tokenizer | None = Tokenizer(config.model)
        except TokenizerError:
            self.tokenizer = None  # token-id prompts still work
        mc = config.model_config
        # The config's (config.json, generation_config.json) and the tokenizer's: a fine-tune that
        # changed its tokenizer's eos_token stops on it (as in vLLM, whose primary EOS is the
        # tokenizer's), and one whose config names more stops on those too.
        tokenizer_eos = self.tokenizer.eos_token_id if self.tokenizer else None
        self.eos_token_ids = tuple(mc.eos_token_ids) + (
            (tokenizer_eos,) if tokenizer_eos is not None and tokenizer_eos not in mc.eos_token_ids else ()
        )
        # The primary EOS (the tokenizer's, else the config's first): vLLM treats the others as stop
        # token ids, so a request they end reports them as its stop_reason.
        self.primary_eos = tokenizer_eos if tokenizer_eos is not None else (self.eos_token_ids or (None,))[0]
        self.grammars = (  # structured outputs; llguidance's view of the vocabulary is built on first use
            GrammarBackend(
                self.tokenizer.to_json(),
                mc.vocab_size,
                self.eos_token_ids,
                lambda token_id: self.tokenizer.decode([token_id], skip_special_tokens=False),
            )
            if self.tokenizer is not None
            else None
        )
        self.cache_generation = 0  # bumped by every weight update: part of the prefix cache's key root
        self.kv = KVManager(
            self.runner.num_pages,
            config.cache.page_size,
            config.cache.enable_prefix_caching,
            namespace=self._cache_namespace(),
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.requests: dict[str, Request] = {}
        self._prompts: dict[str, str | None] = {}
        self._counter = itertools.count()
        self.num_generated_tokens = 0
        # Called after every step with its SchedulerOutput (PD roles stream finished pages from here).
        self.step_hooks: list = []
        self.pre_step_hooks: list = []  # after scheduling, before the forward (KV already computed)
        # Called with each request that stopped in a step, before its pages are freed: the step hooks
        # run after, when a finished request's pages are gone (the decode's last block write-back).
        self.finish_hooks: list = []
        # Page references held outside any request's page list (PD prefill write pins): each hook
        # returns the page ids it holds a reference on, one entry per reference (check_integrity).
        self.extra_page_refs: list = []
        # A PD prefill holds only each prompt's KV (it samples one token, which takes no slot; the
        # output grows on the decode): `make_request` checks its pool against the prompt alone.
        self.holds_prompt_kv_only = False
        self.weights_dir = config.model  # where the served weights came from (update_weights)
        self.num_weight_updates = 0
        self.weight_version = "default"  # a trainer's label of the weights served (SGLang's; set by updates)
        self.weights_lost: str | None = None  # set when an update left the weights inconsistent
        # What `release_memory` gave back ("kv_cache", "weights"): no request runs until it is resumed
        self.released: set[str] = set()

    # ---- intake --------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
            if unknown:  # (e.g. multi_modal_data: generating from the text alone would be a wrong answer)
                raise InvalidRequest(
                    f"prompt fields {unknown} are not supported (only prompt, prompt_token_ids, cache_salt)"
                )
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequest("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequest("a prompt is a string or a list of token ids")
        ids = list(prompt)
        vocab = self.config.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        return None, ids

    def make_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tokenized: tuple[str | None, list[int]] | None = None,
        default_max_tokens: int | None = None,
        cap_max_tokens: bool = False,
    ) -> Request:
        """Validate and build a request without queueing it; raises InvalidRequest. Read-only, so the
        server calls it on its own thread and answers 400 before the engine thread sees anything.

        `prompt` is a string, a list of token ids or a dict with `prompt` / `prompt_token_ids` (and vLLM's
        `cache_salt`: the request's KV keys are salted with it, `hashing.salted_root`);
        `tokenized` (from `tokenize_prompt`) skips tokenizing it again. `params.max_tokens` None means
        up to the context length, or `default_max_tokens` (an API's default the client did not set,
        e.g. SGLang's 128; raised to `min_tokens`) lowered to the room the prompt leaves: a default
        never refuses a prompt. `cap_max_tokens` (the offline API, as vLLM's): a max_tokens past the
        room the prompt leaves ends there ("length") instead of refusing the request.
        """
        if self.weights_lost:
            raise WeightsLost(f"this engine's weights are inconsistent: {self.weights_lost}")
        self._check_awake()
        if params.n != 1:  # (one sequence per request)
            raise InvalidRequest(
                f"n={params.n}: one request per choice (LLM.generate and the HTTP routes split n)"
            )
        text, ids = tokenized if tokenized is not None else self.tokenize_prompt(prompt)
        if not ids:
            raise InvalidRequest("prompt is empty")
        request_id = request_id if request_id is not None else self.new_request_id()
        max_len = self.config.scheduler.max_model_len
        num_prompt = len(ids)
        if num_prompt >= max_len:
            raise InvalidRequest(
                f"prompt has {num_prompt} tokens; this model's maximum context length is {max_len} tokens"
            )
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = max_len - num_prompt
            if default_max_tokens is not None:  # (raised to min_tokens: a default never refuses)
                max_tokens = min(max_tokens, max(default_max_tokens, params.min_tokens))
            if params.min_tokens > max_tokens:  # (SamplingParams checks it against a max_tokens given)
                raise InvalidRequest(
                    f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens the maximum context "
                    f"length of {max_len} leaves after the prompt ({num_prompt} tokens)"
                )
        if cap_max_tokens and num_prompt + max_tokens > max_len and params.min_tokens <= max_len - num_prompt:
            max_tokens = max_len - num_prompt
        if num_prompt + max_tokens > max_len:
            # (worded so that the figures read as in vLLM's and OpenAI's refusals: agent clients parse
            # "too large: N" and "maximum context length is N" to shrink max_tokens and retry)
            raise InvalidRequest(
                f"max_tokens is too large: {max_tokens}. This model's maximum context length is {max_len} "
                f"tokens and the prompt has {num_prompt} tokens ({max_tokens} > {max_len} - {num_prompt})"
            )
        # (the last token sampled is never computed, so it holds no KV: prompt + max_tokens - 1 slots)
        num_kv_tokens = num_prompt if self.holds_prompt_kv_only else num_prompt + max_tokens - 1
        if self.kv.num_pages_for(num_kv_tokens) > self.kv.pool.num_pages:
            raise InvalidRequest("request needs more KV pages than this engine has in total")
        vocab = self.config.model_config.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequest(f"logprobs={params.logprobs} exceeds the vocabulary of {vocab} tokens")
        if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:  # (topk inside a step)
            raise InvalidRequest(
                f"prompt_logprobs={params.prompt_logprobs} exceeds the vocabulary of {vocab} tokens"
            )
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequest(
                f"logit_bias token id {max(params.logit_bias)} is outside the vocabulary of {vocab}"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        # (the model's EOS ids even under ignore_eos, which only keeps them from stopping it: min_tokens
        # still bans them, as vLLM does)
        req = Request(request_id, ids, params, max_tokens, self.eos_token_ids)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            salt = prompt["cache_salt"]
            if not isinstance(salt, str) or not salt:
                raise InvalidRequest(f"cache_salt must be a non-empty string, got {salt!r}")
            req.cache_salt = salt
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequest("structured outputs need a tokenizer; this model has none")
            try:
                req.grammar = self.grammars.grammar_for(params.structured_outputs)
            except InvalidGrammar as e:
                raise InvalidRequest(str(e)) from None
        return req

    def add(self, req: Request, prompt_text: str | None = None) -> None:
        """Queue a request built by `make_request` (engine thread only)."""
        self._check_awake()  # (checked again: memory may have been released since `make_request`)
        if self.weights_lost:  # (and the weights lost since: a request held by a pause ran on them)
            raise WeightsLost(f"this engine's weights are inconsistent: {self.weights_lost}")
        if req.request_id in self.requests:
            raise DuplicateRequestId(f"request id {req.request_id!r} is already active")
        self.requests[req.request_id] = req
        self._prompts[req.request_id] = prompt_text
        self.runner.add_request(req)
        self.scheduler.add(req)

    def add_request(
        self,
        prompt,
        params: SamplingParams,
        request_id: str | None = None,
        tokenized: tuple[str | None, list[int]] | None = None,
        cap_max_tokens: bool = False,
    ) -> str:
        """`make_request` + `add`. Raises InvalidRequest without changing any state."""
        tokenized = tokenized if tokenized is not None else self.tokenize_prompt(prompt)
        req = self.make_request(prompt, params, request_id, tokenized, cap_max_tokens=cap_max_tokens)
        self.add(req, tokenized[0])
        return req.request_id

    def new_request_id(self) -> str:
        """A fresh id (what `add_request` gives a request without one): for callers that name a group of
        requests (the offline API's choices of one prompt, `<id>_<j>`)."""
        return f"req-{next(self._counter)}"

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages now. PD requests are aborted through their role's
        coordinator instead, which frees pages only once no transfer can touch them."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status.finished:  # held pages (PD prefill): release them
            self.kv.free(req)
            return self.release(req)
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self.release(req)

    # ---- the step ------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        for hook in self.pre_step_hooks:
            hook(sched)
        sampled_reqs, result = self.runner.execute(sched)
        now = time.monotonic()
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            req.num_computed_tokens += n
        outputs: list[RequestOutput] = []
        for i, req in enumerate(sampled_reqs):
            token = result.token_ids[i]
            req.append_output(token)
            self.num_generated_tokens += 1
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if result.logprobs[i] is not None:
                req.logprobs.append(TokenLogprob(token, *result.logprobs[i]))
            status = self.check_stop(req)
            self.kv.cache_computed_pages(req)
            if status is not None:
                for hook in self.finish_hooks:
                    hook(req)
            if status is not None and req.hold_pages:
                self.scheduler.finish(req, status, free_pages=False)
                outputs.append(self.output(req))  # stays in `requests` until release_held()
            elif status is not None:
                self.scheduler.finish(req, status)
                outputs.append(self.release(req))
            else:
                outputs.append(self.output(req))
        sampled = set(map(id, sampled_reqs))
        for req in sched.requests:  # prefill chunks that did not sample still publish full pages
            if req.status == RequestStatus.RUNNING and id(req) not in sampled:
                self.kv.cache_computed_pages(req)
        for hook in self.step_hooks:
            hook(sched)
        return outputs

    def release_held(self, req: Request) -> None:
        """Free the pages of a finished request that kept them (PD prefill after the decode's ack)."""
        if self.requests.get(req.request_id) is not req:
            return
        if not req.status.finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED, free_pages=False)
        self.kv.free(req)
        self.release(req)

    def retract_running(self) -> int:
        """Engine thread (a pause's "retract"): free the pages of every running request and queue it
        again (Scheduler.retract_all); returns how many."""
        return len(self.scheduler.retract_all())

    def update_weights(
        self,
        model_dir: str,
        abort_running: bool = False,
        on_abort=None,
        abort=None,
        keep_running: bool = False,
    ) -> int:
        """Engine thread: serve the weights of `model_dir` from now on (an RL trainer's new
        checkpoint; same architecture and shapes). Cached prefix pages were computed with the old
        weights, so the prefix cache is dropped. With requests in flight: EngineBusy, or with
        `abort_running` they are aborted first, each final output handed to `on_abort` at once. A
        checkpoint that does not match is refused (InvalidRequest, CheckpointError) before any weight
        changes or any request is aborted. If copying fails midway (the files changed meanwhile), the
        previous weights are loaded back (CheckpointError); if that fails too, WeightsLost and the
        engine refuses requests (`weights_lost`) until an update succeeds. Returns the cached pages dropped. `abort` (request id ->
        its final output or None) replaces `self.abort` for that (a PD role ends its rooms with it).
        `keep_running` (the engine is paused in place or retracted, AsyncEngine.pause): the requests in
        flight stay, to go on under the new weights on resume (SGLang's in-place update): a retracted
        one is recomputed by them; one paused in place keeps the pages the old ones computed, and the
        pages it completes later (their KV computed by both) are never offered to other requests."""
        if "weights" in self.released:  # (they would be copied into freed parameters)
            raise EngineBusy("this engine's weights are released: resume them first (/wake_up?tags=weights)")
        current = self.config.model_config
        try:
            new = ModelConfig.from_dir(model_dir)
        except (ConfigError, OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise InvalidRequest(f"cannot read {model_dir}/config.json: {e}") from None
        same = dict(torch_dtype=current.torch_dtype, eos_token_ids=current.eos_token_ids)
        if dataclasses.replace(new, bos_token_id=current.bos_token_id, **same) != current:
            raise InvalidRequest(f"{model_dir} is not the same model shape as the one served")
        loader.check_checkpoint(self.runner.model, model_dir, current)
        if self.requests and not abort_running and not keep_running:
            raise EngineBusy(f"{len(self.requests)} requests are in flight (abort_running: true aborts them)")
        for rid in list(self.requests) if not keep_running else ():
            out = (abort or self.abort)(rid)
            if out is not None and on_abort is not None:
                on_abort(out)
        for req in self.requests.values():  # (kept: `keep_running`)
            if req.page_ids:
                req.publish_pages = False
            else:  # (queued or retracted: its keys start again from the new root when it is admitted)
                req.page_key_cache.clear()
        dropped = self.kv.pool.reset_prefix_cache()  # (before any copy: no page may outlive its weights)
        # Pages still referenced (a PD room aborted but not yet released: its writes in flight, its
        # decode's ack awaited) keep their keys and return to the cache when freed: keys computed from
        # now on start from another root, so no request hits them. (Bumped whatever the outcome: a
        # failed load restores the old weights, and pages cached then must not meet the next ones.)
        self.cache_generation += 1
        self.kv.root = root_key(self._cache_namespace())
        try:
            loader.load_weights_into(self.runner.model, model_dir, current)
        except Exception as e:
            if Path(model_dir).resolve() == Path(self.weights_dir).resolve():
                # A trainer that rewrites one directory: the served weights' files are these new ones
                # (or half of them); "restored" from there, the engine served them while it answered
                # that the previous weights were back (a review, 2026-12-04).
                self._lose_weights(
                    f"loading {model_dir} failed ({e!r}); it held the served weights", abort, on_abort
                )
                raise WeightsLost(self.weights_lost) from e
            try:
                loader.load_weights_into(self.runner.model, self.weights_dir, current)
            except Exception as e2:
                why = f"loading {model_dir} failed ({e!r}), restoring {self.weights_dir} too ({e2!r})"
                self._lose_weights(why, abort, on_abort)
                raise WeightsLost(self.weights_lost) from e2
            raise CheckpointError(f"loading failed midway ({e!r}); the previous weights are back") from e
        # Every tensor was loaded and checked: weights an earlier failed restore left inconsistent are
        # all replaced (the engine served 503s after any later update until a restart)
        self.weights_lost = None
        self.weights_dir = model_dir
        self.num_weight_updates += 1
        return dropped

    def _lose_weights(self, why: str, abort, on_abort) -> None:
        """The weights are neither the old nor the new ones: refuse requests until an update succeeds,
        and end those kept across the update (paused in place or retracted), which went on to finish
        as 200s on them (a review, 2026-12-04)."""
        self.weights_lost = why
        for rid in list(self.requests):
            out = (abort or self.abort)(rid)
            if out is not None and on_abort is not None:
                on_abort(out)

    # ---- memory given back between rollouts -----------------------------------------------------
    def release_memory(self, tags: tuple[str, ...] = MEMORY_TAGS, keep_weights_on_host: bool = False) -> int:
        """Engine thread, idle engine only (EngineBusy otherwise): give memory back while an RL trainer
        colocated with this engine trains (vLLM's sleep mode, SGLang's release_memory_occupation).
        "kv_cache": the pool's K and V buffers are freed (the prefix cache is dropped with them:
        returns its pages); "weights": the parameters are freed, or with `keep_weights_on_host`
        (vLLM's level 1) moved to host memory, where a CPU engine's already are (kept as they are).
        Until `resume_memory` brings all back, requests are refused (EngineAsleep)."""
        _check_tags(tags)
        if self.requests:
            raise EngineBusy(f"{len(self.requests)} requests are in flight (pause or abort them first)")
        dropped = 0
        if "kv_cache" in tags and "kv_cache" not in self.released:
            dropped = self.kv.pool.reset_prefix_cache()  # (every page is free: no request holds one)
            self.runner.release_kv()
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            if self.runner.release_weights(keep_weights_on_host):
                self.released.add("weights")
            if not keep_weights_on_host:  # (reloaded from disk, where a trainer may have rewritten the
                # checkpoint in place: no page the weights before computed may meet the ones after)
                dropped += self.kv.pool.reset_prefix_cache()
                self.cache_generation += 1
                self.kv.root = root_key(self._cache_namespace())
        self.runner.return_freed_memory()
        return dropped

    def resume_memory(self, tags: tuple[str, ...] = MEMORY_TAGS) -> None:
        """Engine thread: bring back what `release_memory` gave back (those of `tags`): the KV buffers,
        zeroed; the weights from host memory, or loaded again from the checkpoint last served
        (`weights_dir`; if that fails the engine's weights are lost: WeightsLost, 503s until an
        update succeeds)."""
        _check_tags(tags)
        if "kv_cache" in tags and "kv_cache" in self.released:
            self.runner.restore_kv()
            self.released.discard("kv_cache")
        if "weights" in tags and "weights" in self.released:
            self.released.discard("weights")
            try:
                self.runner.restore_weights(self.weights_dir)
            except Exception as e:
                self.weights_lost = f"reloading {self.weights_dir} after a release failed: {e!r}"
                raise WeightsLost(self.weights_lost) from e

    def _check_awake(self) -> None:
        if self.released:
            what = " and ".join(sorted(self.released))
            raise EngineAsleep(
                f"this engine's {what} memory is released (POST /wake_up or /resume_memory_occupation)"
            )

    def _cache_namespace(self) -> str:
        """The prefix cache's key root: the model, the pool layout and the weights' generation."""
        mc = self.config.model_config
        return f"{mc.architecture}:{self.runner.kv_cache.layout.fingerprint()}:g{self.cache_generation}"

    def add_prefilled(self, req: Request, prompt_text: str | None = None) -> None:
        """Register a request whose pages and prompt KV were set up outside the scheduler (PD decode)."""
        if req.request_id in self.requests:
            raise DuplicateRequestId(f"request id {req.request_id!r} is already active")
        self.requests[req.request_id] = req
        self._prompts[req.request_id] = prompt_text
        self.runner.add_request(req)

    def check_stop(self, req: Request) -> RequestStatus | None:
        """Why the request must stop after its newest token (None: go on). Engine thread only."""
        token = req.output_token_ids[-1]
        params = req.sampling_params
        # A grammar that allows no further token ends the request (min_tokens cannot outlast it).
        grammar_done = req.grammar is not None and req.grammar.terminated
        if req.num_output_tokens <= params.min_tokens and not grammar_done:
            # Stop strings count only in text after the first min_tokens tokens (vLLM's rule): a later
            # match must end after this text. Below min_tokens the sampler gave no stop token either.
            if params.stop and self.tokenizer is not None:
                # (a character whose bytes are still arriving is not min_tokens text: the token that
                # completes it adds it, as vLLM's detokenizer never emits a partial character)
                # (never less than before: an open byte-fallback run hides complete characters before
                # it for a few steps, and text already min_tokens text stays so)
                text = self._text(req).rstrip("\ufffd")
                req.num_min_text_chars = req.num_stop_checked_chars = max(req.num_min_text_chars, len(text))
            if req.num_output_tokens < params.min_tokens:
                return RequestStatus.FINISHED_LENGTH if req.num_output_tokens >= req.max_tokens else None
        if token in req.eos_token_ids and not params.ignore_eos:
            req.stopped_on_token = True
            if token != self.primary_eos:
                req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            req.stop_reason, req.stopped_on_token = token, True
            return RequestStatus.FINISHED_STOPPED
        if params.stop and self.tokenizer is not None:
            text = self._text(req)
            # New text since the last check, plus what a stop string may have started in before it
            # (one token can add many characters), plus a margin: a partial UTF-8 character at the end
            # decodes to U+FFFD until its next byte arrives, so earlier text may still change a little.
            tail_from = max(0, req.num_stop_checked_chars - max(len(s) for s in params.stop) - 16)
            # (not counting a trailing run of U+FFFD: a byte-fallback decoder shows an open run as one
            # per byte, ~4x the text it becomes, and a mark past it skipped the run's characters)
            req.num_stop_checked_chars = len(text.rstrip("\ufffd"))
            for s in params.stop:
                # (a match may start inside the min_tokens text, but must end after it)
                at = text.find(s, max(tail_from, req.num_min_text_chars - len(s) + 1))
                if at >= 0:
                    req.stop_reason = s
                    return RequestStatus.FINISHED_STOPPED
        if grammar_done:
            if req.grammar.failed:  # (finish_reason "abort"; stop_reason says why)
                req.stop_reason = f"structured output failed: {req.grammar.failed}"
                return RequestStatus.FINISHED_ABORTED
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- outputs -------------------------------------------------------------------------------
    def _text(self, req: Request) -> str:
        """The output's text: decoded a few tokens per step while it grows (a full decode at every
        step is O(output) per step), and once in full when the request has finished (exactly the
        tokenizer's decode, a trailing incomplete character as U+FFFD included)."""
        if self.tokenizer is None:
            return ""
        skip = req.sampling_params.skip_special_tokens
        if req.decode_context is None:  # (the prompt's last tokens: a SentencePiece output's first space)
            req.decode_context = self.tokenizer.decode_context(req.prompt_token_ids, skip)
        if req.status.finished:
            ids = req.output_token_ids
            if req.stopped_on_token and not req.sampling_params.include_stop_str_in_output:
                ids = ids[:-1]  # the stop token's own text is not part of the answer (as in vLLM)
            return self.tokenizer.decode_after(req.decode_context, ids, skip)
        if req.detokenizer is None:
            req.detokenizer = self.tokenizer.incremental(skip, req.decode_context)
        return req.detokenizer.update(req.output_token_ids)

    @staticmethod
    def _cumulative_logprob(req: Request) -> float | None:
        """vLLM's: the sum of the sampled tokens' logprobs (None unless logprobs were asked for); kept
        as a running sum, so a stream's outputs cost O(new tokens) each."""
        if req.sampling_params.logprobs is None:
            return None
        done, total = req.logprob_sum
        for t in req.logprobs[done:]:
            total += t.logprob
        req.logprob_sum = (len(req.logprobs), total)
        return total

    def _shown_text(self, req: Request) -> str:
        """The output's text as callers see it: it only grows, so a stream never takes back what it
        showed (vLLM's detokenizer rule). While the request runs, a trailing incomplete character
        (U+FFFD) is held back until its bytes arrive. The decoder's text is not monotonic by itself:
        with a byte-fallback vocabulary (Llama 2, Mistral) tokenizers' ByteFallback decoder renders an
        open run of byte tokens as one U+FFFD per byte, characters already complete in it included,
        until the run is valid again ("ok😀" + the first byte of "😁" decodes to "ok" + 5 x U+FFFD), and
        for good when a later byte makes the run invalid. The first case waits until the decoder's text
        extends what was shown again; in the second (the run is over), what the decoder adds past its
        earlier length follows. So the finished text is the full decode unless such an invalid run
        rewrote text already shown, where it keeps what was shown (as vLLM's does)."""
        text = self._text(req)
        open_run = False
        if not req.status.finished:
            ids = req.output_token_ids
            open_run = text.endswith("\ufffd") or bool(ids and ids[-1] in self.tokenizer.byte_token_ids)
            text = text.rstrip("\ufffd")
        if text.startswith(req.text_decoded) or not open_run:
            req.text_shown += text[len(req.text_decoded) :]
            req.text_decoded = text
        return req.text_shown

    def output(self, req: Request) -> RequestOutput:
        """The request as its caller sees it now (text with stop strings cut)."""
        text = self._shown_text(req) if self.tokenizer is not None else ""
        stop = req.sampling_params.stop
        if isinstance(req.stop_reason, str) and req.status.finished:
            cut = text.find(req.stop_reason, max(0, req.num_min_text_chars - len(req.stop_reason) + 1))
            if cut >= 0:
                text = text[
                    : cut + (len(req.stop_reason) if req.sampling_params.include_stop_str_in_output else 0)
                ]
        elif stop and not req.status.finished and not req.sampling_params.include_stop_str_in_output:
            # Hold back what may be the start of a stop string: a streamed delta must never show text
            # that the final output cuts. The stop is not complete yet, so it starts at or after
            # len(text) - (longest - 1). (A kept stop string cuts nothing before its end: no hold-back.)
            text = text[: max(0, len(text) - (max(len(s) for s in stop) - 1))]
        finish = req.status.value if req.status.finished else None
        return RequestOutput(
            request_id=req.request_id,
            prompt=self._prompts.get(req.request_id),
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    text,
                    _snapshot(req.output_token_ids, req.status.finished),
                    _snapshot(req.logprobs, req.status.finished)
                    if req.sampling_params.logprobs is not None
                    else None,
                    finish,
                    req.stop_reason,
                    self._cumulative_logprob(req),
                )
            ],
            finished=req.status.finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics={
                "arrival_time": req.arrival_time,
                "first_token_time": req.first_token_time,
                "last_token_time": req.last_token_time,
                "cached_tokens_storage": req.num_storage_tokens,
                "num_preemptions": req.num_preemptions,
            },
            # (complete once the prompt is computed, i.e. from the first output on; the engine only
            # appends to it, so the list itself is handed out)
            prompt_logprobs=req.prompt_logprobs,
        )

    def release(self, req: Request) -> RequestOutput:
        """Forget a finished request whose pages were already freed; returns its final output."""
        out = self.output(req)
        del self.requests[req.request_id]
        self._prompts.pop(req.request_id, None)
        self.runner.remove_request(req.request_id)
        return out

    def check_integrity(self) -> None:
        """Pool invariants, plus: every page's reference count is the number of active requests that
        hold it, plus the references the engine's roles hold (`extra_page_refs`: a PD prefill's pins
        of pages its writes still read). So with no request active, no page is in use."""
        self.kv.check_integrity()
        expected = [0] * self.kv.pool.num_pages
        for req in self.requests.values():
            # (a page twice in one table: two positions would share one page's KV, and the counts
            # would still agree)
            assert len(set(req.page_ids)) == len(req.page_ids), f"request {req.request_id} holds a page twice"
            for page in req.page_ids:
                expected[page] += 1
            # A page is published to the prefix cache only once every one of its tokens is computed,
            # under the key it was published with: else a later prompt reuses a page with a slot never
            # written, and every count above still agrees (a review, 2026-12-05, by an off-by-one put
            # in on purpose: outputs diverged, every check passed).
            ps, rid = self.kv.page_size, req.request_id
            # (a finished request may hold no pages for what it computed: a PD prefill's layerwise run
            # writes its KV straight to the decode)
            assert req.status.finished or req.num_computed_tokens <= len(req.page_ids) * ps, (
                f"{rid}: computed past its pages ({req.num_computed_tokens} tokens, {len(req.page_ids)} pages"
                f" of {ps})"
            )
            assert len(req.page_keys) <= req.num_computed_tokens // ps, f"{rid}: published an uncomputed page"
            for page, key in zip(req.page_ids, req.page_keys, strict=False):
                assert self.kv.pool.key_of(page) in (None, key), (
                    f"{rid}: page {page} cached under another key"
                )
        queued = [r.request_id for r in itertools.chain(self.scheduler.waiting, self.scheduler.running)]
        assert len(set(queued)) == len(queued), "a request queued twice (or both waiting and running)"
        assert set(queued) <= set(self.requests), "a queued request the engine does not know"
        for hook in self.extra_page_refs:
            for page in hook():
                expected[page] += 1
        actual = self.kv.pool.ref_counts()
        wrong = [p for p in range(len(actual)) if actual[p] != expected[p]]
        assert not wrong, (
            f"{len(wrong)} pages with a reference count unlike their holders', e.g. page {wrong[0]}: "
            f"{actual[wrong[0]]} references, {expected[wrong[0]]} holders"
        )


def _snapshot(items: list, finished: bool):
    """What an output carries of a list the engine keeps appending to: a copy once the request has
    finished (nothing is appended any more; callers own it), else an O(1) view of its current length."""
    return list(items) if finished else GrowingPrefix(items)


def _check_tags(tags: tuple[str, ...]) -> None:
    """InvalidRequest for a tag `release_memory` / `resume_memory` do not know."""
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown:
        raise InvalidRequest(f"unknown memory tags {sorted(unknown)}: choose from {', '.join(MEMORY_TAGS)}")

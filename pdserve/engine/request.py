"""`Request`: the one object that follows a request through the engine (nano-vllm's `Sequence`).

Token accounting, the same for prefill, chunked prefill, decode and recompute after preemption:

    all_token_ids  = prompt_token_ids + output_token_ids
    [0, num_computed_tokens)            KV is in the pool (page_ids cover these tokens)
    [num_computed_tokens, num_tokens)   still to compute; a step computes a prefix of this range
    when num_computed_tokens reaches num_tokens, the step samples the next token

The page table maps token position p to slot page_ids[p // page_size] * page_size + p % page_size.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.kvcache.hashing import PageKey
from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were likelier, ties ranking with it (vLLM's)


@dataclass(eq=False)  # identity semantics: queues remove by `is`, not by field equality
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    page_ids: list[int] = field(default_factory=list)
    page_keys: list[PageKey] = field(default_factory=list)  # chained keys of full computed pages
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    waited_for_prefix: bool = False  # put off at admission for a prompt page another request computed
    status: RequestStatus = RequestStatus.WAITING
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt_logprobs: [None, then token i's given tokens < i], filled as the prompt is computed
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    stop_reason: int | str | None = None
    stopped_on_token: bool = False  # finished by an EOS or stop_token_ids token (its text is left out)
    num_stop_checked_chars: int = 0  # output text length at the last stop-string check
    num_min_text_chars: int = 0  # output text length while under min_tokens: a stop match ends after it
    prompt_unique_ids: Any = None  # sorted distinct prompt ids (np.int64), for the repetition penalty
    detokenizer: Any = None  # the output's text, a few tokens per step (tokenizer.IncrementalDetokenizer)
    # What the outputs have shown of the text (it only grows: LLMEngine._shown_text), and the decoder's
    # text it was built from.
    text_shown: str = ""
    pd_router_id: str = ""  # a PD half: the router that sent it (`pd.router_id`; server/api.py)
    pd_router_named: int = 0  # ... and how many named aborts that router had taken when it sent it
    text_decoded: str = ""
    # prompt tokens the output is decoded after (Tokenizer.decode_context)
    decode_context: list[int] | None = None
    logprob_sum: tuple[int, float] = (0, 0.0)  # (logprobs summed, their sum): cumulative_logprob
    grammar: Any = None  # structured outputs: the matcher every output token advances (model/grammar.py)
    # PD disaggregation: a prefill request keeps its pages after it finishes until the decode acked
    # the transfer (`LLMEngine.release_held`); `pd` holds the role's per-request transfer state.
    hold_pages: bool = False
    pd: Any = None
    read_path: str = "none"  # DualPath: where prompt KV found in the persistent store is read: none|pe|de
    # The id the client knows the request by ("cmpl-" + its request_id; children "<id>_<i>"), when it
    # is not `request_id`: it names the answer and /abort_request takes it. Two requests may share it
    # (a PD leg and its retry on one decode, a client reusing an id); `request_id` stays unique.
    client_id: str | None = None
    abort_epoch: int = 0  # AsyncEngine.num_aborts when it arrived (set by AsyncEngine.validate)
    num_storage_tokens: int = 0  # prompt tokens whose KV came from the persistent store
    # Chained keys of the full pages / store blocks of all_token_ids, computed once: the token list
    # only ever grows, so a key, once computed, never changes (see hashing.cached_keys).
    # Their chains start at the engine's roots salted with `cache_salt` (vLLM's field: set before the
    # request is queued, never after; see hashing.salted_root).
    page_key_cache: list = field(default_factory=list)
    block_key_cache: list = field(default_factory=list)
    cache_salt: str | None = None
    # False once weights changed under it while it kept its pages (a pause in place): its KV mixes two
    # weights' computations, so the pages it completes from then on are never offered to other requests.
    publish_pages: bool = True
    # Full store blocks of this request already queued for write-back (on the request, not a table by
    # id: an id used again by a later request must not inherit the count).
    num_blocks_persisted: int = 0
    page_id_row: Any = None  # (page_ids list, the same ids as int64 array): ModelRunner._page_row

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output(self, token_id: int) -> None:
        """Every output token comes through here: sampled, or (PD decode) token 1 from the prefill."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

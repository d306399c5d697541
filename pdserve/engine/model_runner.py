"""Worker side of one engine step: scheduler output (page ids) -> tensors -> forward -> samples.

The scheduler never sees a tensor; this is where page ids become slots. For a request computing
tokens [start, start + n):
    positions  start .. start+n-1
    slots      page_ids[p // page_size] * page_size + p % page_size
"""

from __future__ import annotations

import gc
from array import array

import numpy as np
import torch

from pdserve.config import EngineConfig
from pdserve.engine.request import Request, TokenLogprob
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvcache.kv_cache import KVCache
from pdserve.model import loader
from pdserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from pdserve.model.loader import DTYPES, load_model
from pdserve.model.sampler import Sampler, SampleResult

PROMPT_LOGPROBS_ROWS = 256  # positions per logits slice for prompt logprobs ([256, V] float32 at a time)


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        self.device = config.device
        self.dtype = DTYPES[config.dtype]
        self.page_size = config.cache.page_size
        max_positions = max(config.scheduler.max_model_len, 1)
        self.model = load_model(config.model, mc, config.dtype, config.device, max_positions)
        num_pages = config.cache.pool_pages(mc, config.dtype)
        self.kv_cache = KVCache(mc, num_pages, self.page_size, self.dtype, config.device)
        self._kv_views = self.kv_cache.flat_views()
        self._windows = sorted({w for w in mc.sliding_windows if w is not None})
        self.sampler = Sampler(config.device, config.seed)
        self.generators: dict[str, torch.Generator] = {}  # request_id -> its own RNG (seeded requests)
        # name -> (shape, host copy or None) of each parameter while released (`release_weights`)
        self._released_params: dict[str, tuple[torch.Size, torch.Tensor | None]] | None = None

    # ---- memory given back between rollouts (LLMEngine.release_memory) ------------------------------
    def release_kv(self) -> None:
        self.kv_cache.release()
        self._kv_views = []

    def restore_kv(self) -> None:
        self.kv_cache.restore()
        self._kv_views = self.kv_cache.flat_views()

    def release_weights(self, keep_host_copy: bool) -> bool:
        """Free the parameters' memory on the device (buffers, e.g. rotary tables, stay). With
        `keep_host_copy` (vLLM's sleep level 1) they are copied to host memory first; on a CPU device
        they are host memory already, so nothing is released (False). Without it they are gone, to be
        loaded again from a checkpoint (`restore_weights`)."""
        on_host = torch.device(self.device).type == "cpu"
        if keep_host_copy and on_host:
            return False
        self._released_params = {}
        for name, p in self.model.named_parameters():  # (tied parameters once: one object)
            host = p.detach().to("cpu", copy=True) if keep_host_copy else None
            self._released_params[name] = (p.shape, host)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return True

    def return_freed_memory(self) -> None:
        """On a GPU, hand what was just freed back to the device: PyTorch's caching allocator would keep
        it reserved for this process, out of reach of a trainer in another one."""
        if torch.device(self.device).type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    def restore_weights(self, model_dir: str) -> None:
        """The parameters back: from their host copy, else loaded from `model_dir` (CheckpointError if
        it fails: the caller marks its weights lost)."""
        released, self._released_params = self._released_params, None
        for name, p in self.model.named_parameters():
            shape, host = released[name]
            p.data = (
                host.to(self.device)
                if host is not None
                else torch.empty(shape, dtype=p.dtype, device=self.device)
            )
        if any(host is None for _, host in released.values()):
            loader.load_weights_into(self.model, model_dir, self.config.model_config)

    def add_request(self, req: Request) -> None:
        if req.sampling_params.seed is not None:
            self.generators[req.request_id] = self.sampler.new_generator(req.sampling_params.seed)

    def remove_request(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    @property
    def num_pages(self) -> int:
        return self.kv_cache.layout.num_pages

    def _tensor(self, data, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, dict, list[int]]:
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillChunk] = []
        decode_rows: list[int] = []
        decode_reqs: list[Request] = []
        sample_rows: list[int] = []
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            start = req.num_computed_tokens
            row = len(input_ids)
            pages = req.page_ids
            input_ids.extend(req.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(pages[p // ps] * ps + p % ps for p in range(start, start + n))
            if start + n == req.num_tokens:
                sample_rows.append(row + n - 1)
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_reqs.append(req)
            elif start == 0:
                prefills.append(PrefillChunk(row, n, 0, None, None))
            else:
                ctx = start + n
                kv_pages = self._tensor(pages[: -(-ctx // ps)])
                q_pos = torch.arange(start, ctx, device=self.device)[:, None]
                mask = torch.arange(ctx, device=self.device)[None, :] <= q_pos
                prefills.append(PrefillChunk(row, n, start, kv_pages, mask))
        meta = AttentionMetadata(
            self._tensor(slots), prefills, self._decode_groups(decode_reqs, decode_rows), ps
        )
        window_masks = {w: self._window_masks(meta, w) for w in self._windows}
        return self._tensor(input_ids), self._tensor(positions), meta, window_masks, sample_rows

    def _decode_groups(self, reqs: list[Request], rows: list[int]) -> list[DecodeGroup]:
        """Sort decodes by context pages; cut a new group when padding to the group's longest context
        would waste more than a quarter of the work (groups of at least 4, so few SDPA calls)."""
        ps = self.page_size
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].num_computed_tokens)
        groups: list[tuple[int, list[int]]] = []  # (pages of the group's shortest member, members)
        for i in order:
            pages = reqs[i].num_computed_tokens // ps + 1
            if groups and (len(groups[-1][1]) < 4 or pages * 4 <= groups[-1][0] * 5):
                groups[-1][1].append(i)
            else:
                groups.append((pages, [i]))
        return [self._decode_group([reqs[i] for i in g], [rows[i] for i in g]) for _, g in groups]

    @staticmethod
    def _page_row(req: Request) -> array:
        """The request's page ids as int64, kept on it across steps and extended as its list grows
        (it is only appended to, and replaced when its pages are freed): decode page tables copy
        these rows instead of converting every id of every row each step (64 decodes at 32k tokens:
        7.8 ms a step, 1.0 ms now)."""
        ids = req.page_ids
        cached = req.page_id_row
        if cached is None or cached[0] is not ids or len(cached[1]) > len(ids):
            req.page_id_row = cached = (ids, array("q", ids))
        elif len(cached[1]) < len(ids):
            cached[1].extend(ids[len(cached[1]) :])
        return cached[1]

    def _decode_group(self, reqs: list[Request], rows: list[int]) -> DecodeGroup:
        ps = self.page_size
        lens = [r.num_computed_tokens + 1 for r in reqs]
        max_pages = -(-max(lens) // ps)  # from the list: reading a device tensor would wait for the GPU
        ctx_lens = self._tensor(lens)
        pages = np.zeros((len(reqs), max_pages), dtype=np.int64)  # padding points at page 0
        for i, r in enumerate(reqs):
            row = self._page_row(r)
            n = min(len(row), max_pages)
            pages[i, :n] = np.frombuffer(row, dtype=np.int64, count=n)
        table = torch.from_numpy(pages).to(self.device)
        key_pos = torch.arange(max_pages * ps, device=self.device)[None, :]
        mask = (key_pos < ctx_lens[:, None])[:, None, None, :]
        return DecodeGroup(self._tensor(rows), table, mask)

    def _window_masks(self, meta: AttentionMetadata, window: int):
        """Sliding-window variants of the step's masks: key j visible to query at q iff q - j < window."""
        chunk_masks = []
        for c in meta.prefills:
            ctx = c.pos_start + c.num_tokens
            q_pos = torch.arange(c.pos_start, ctx, device=self.device)[:, None]
            k_pos = torch.arange(ctx, device=self.device)[None, :]
            chunk_masks.append((k_pos <= q_pos) & (q_pos - k_pos < window))
        decode_masks = []
        for g in meta.decodes:
            k_pos = torch.arange(g.mask.shape[-1], device=self.device)
            q_pos = g.mask.sum(-1, keepdim=True) - 1  # [B,1,1,1] position of each query
            decode_masks.append(g.mask & (q_pos - k_pos < window))
        return chunk_masks, decode_masks

    def _prompt_logprobs(self, req: Request, hidden: torch.Tensor, start: int) -> None:
        """Append the prompt logprobs this chunk's hidden states [n, H] (positions start..) give: the
        state at position p scores prompt token p + 1. Entries already there (a recompute after
        preemption) are not computed again. Logits in slices of PROMPT_LOGPROBS_ROWS positions: a
        whole chunk's [n, V] float32 (8k x 152k) would take 5 GB."""
        k = req.sampling_params.prompt_logprobs
        prompt = req.prompt_token_ids
        first = max(start, len(req.prompt_logprobs) - 1)  # position scoring the next missing entry
        last = min(start + len(hidden), len(prompt) - 1)  # (the last prompt token scores no prompt token)
        for lo in range(first, last, PROMPT_LOGPROBS_ROWS):
            hi = min(lo + PROMPT_LOGPROBS_ROWS, last)
            lp = torch.log_softmax(self.model.compute_logits(hidden[lo - start : hi - start]).float(), dim=-1)
            targets = self._tensor(prompt[lo + 1 : hi + 1])
            chosen = lp.gather(1, targets[:, None])
            ranks = (lp >= chosen).sum(dim=1).tolist()  # (vLLM's: ties with the token rank with it)
            tops = lp.topk(k, dim=-1) if k else None
            top_ids, top_vals = (tops.indices.tolist(), tops.values.tolist()) if k else (None, None)
            for j, (t, v) in enumerate(zip(prompt[lo + 1 : hi + 1], chosen[:, 0].tolist(), strict=True)):
                top = list(zip(top_ids[j], top_vals[j], strict=True)) if k else []
                req.prompt_logprobs.append(TokenLogprob(t, v, top, ranks[j]))

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[list[Request], SampleResult]:
        """Run one step. Returns the requests that reached their newest token, and their samples."""
        input_ids, positions, meta, window_masks, sample_rows = self.prepare(sched)
        hidden = self.model(input_ids, positions, self._kv_views, meta, window_masks)
        row = 0
        for r, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            if r.prompt_logprobs is not None:
                self._prompt_logprobs(r, hidden[row : row + n], r.num_computed_tokens)
            row += n
        reqs = [
            r
            for r, n in zip(sched.requests, sched.num_new_tokens, strict=True)
            if r.num_computed_tokens + n == r.num_tokens
        ]
        if not reqs:
            return [], SampleResult([], [])
        logits = self.model.compute_logits(hidden[self._tensor(sample_rows)]).float()
        gens = [self.generators.get(r.request_id) for r in reqs]
        return reqs, self.sampler(logits, [r.sampling_params for r in reqs], gens, reqs)

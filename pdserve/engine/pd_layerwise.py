"""DualPath layerwise prefill on the prefill engine, for requests whose prompt KV is mostly stored.

For layer l = 0, 1, ...: get layer l's hit KV (PE read path: from our host buffer, filled from the
store; DE read path: pulled from the decode's pages over the data plane), compute the miss tokens of
layer l over it (`CausalLM.forward_layerwise`), and write layer l to the decode — hit + miss tokens on
the PE path (the decode has nothing yet), miss tokens only on the DE path (it has the hits). Only the
current layer's hit KV is ever materialised here, and these requests take no pages of our pool: each
layer goes out of a staging slot that is freed when its write completes.

    tokens     0 ........ hit_tokens .................. N
    PE path    [ host buffer (store) ][ computed here ]   layer l of all of it -> decode
    DE path    [ decode's pages      ][ computed here ]   layer l of the miss part -> decode

Runs on the engine thread, one request at a time (like one prefill step of that request). A run does
not return to the engine loop between layers, so it checks its room itself: before every pull and
every write, and with every wait bounded by the time its room's state has left, it stops (RoomEnded)
once the room failed or its deadline passed. The decode frees an aborted room's pages after its lease,
which assumes a prefill room lives no longer than its state deadlines: no layer may go out later.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pdserve.disagg.state import KVState
from pdserve.engine.request import RequestStatus, TokenLogprob
from pdserve.store.upload import LayerUpload
from pdserve.transfer.pages import merge_runs


class RoomEnded(RuntimeError):
    """The room failed, or its current state's deadline passed, while its layerwise run was going."""


class LayerwisePrefill:
    def __init__(self, role) -> None:
        self.role = role
        self.engine = role.engine
        self.runner = role.engine.runner
        layout = self.runner.kv_cache.layout
        self.page_size = layout.page_size
        self.page_bytes = layout.bytes_per_page
        self.kv_shape = (layout.num_kv_heads, layout.head_dim)
        self.dtype = self.runner.kv_cache.k[0].dtype
        self.num_runs = 0
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="layerwise-h2d")

    def fits(self, pr, num_pull_pages: int) -> bool:
        """Whether a run's staging needs ever fit the pool: one layer's send (pages from the first one
        the decode asked for) next to one layer's pull of `num_pull_pages` (DE path; 0 on the PE path)."""
        staging = self.role.staging
        num_send_pages = -(-pr.req.num_prompt_tokens // self.page_size) - pr.first_page
        need = staging.pages_for(2, max(num_send_pages, 0)) + staging.pages_for(2, num_pull_pages)
        return need <= staging.capacity_pages

    def time_left_s(self, pr, slot: int = -1) -> float:
        """Seconds the room's state has left; RoomEnded (after freeing our staging `slot`, if given)
        when it failed or ran out of time. Looks at the agent's reports first: a write of this room
        reported failed fails the room here, not after the whole run."""
        self.role.drain_completions()
        rooms = self.role.rooms
        if rooms.ended(pr.room):  # (strictly past the deadline, as the room table's own expiry)
            if slot >= 0:
                self.role.staging.free(slot)
            state = self.role.rooms.state(pr.room)
            raise RoomEnded("room failed" if state == KVState.Failed else f"deadline in {state.name}")
        return rooms.time_left_s(pr.room)

    # ---- hit KV sources --------------------------------------------------------------------------
    # A source has start(layer) (begin moving that layer's hit KV; non-blocking) and finish(layer)
    # (wait for it; return k, v [hit_tokens, Hkv, D] on the device). `run` starts layer l+1 before it
    # computes layer l, so the next layer's load overlaps this layer's compute.
    def from_host_buffer(self, buffer: torch.Tensor, num_blocks: int, store_layout):
        """PE path: layer l's hit KV from the blocks read into `buffer` [blocks, block_nbytes]. The copies
        run on a helper thread, a layer ahead of the compute (store/upload.py: pinned staging and a
        side stream on a GPU); torch releases the GIL while copying."""
        upload = LayerUpload(buffer, num_blocks, store_layout, self.runner.device, self.dtype, self.kv_shape)
        futures: dict[int, Future] = {}

        def start(layer: int) -> None:
            futures[layer] = self._copier.submit(upload.copy, layer)

        def finish(layer: int):
            return upload.ready(futures.pop(layer).result())

        return start, finish

    def from_decode_pages(self, pr, hit_page_ids: list[int]):
        """DE path: pull layer l's K and V of the decode's hit pages into a staging slot (a data-plane
        read), then copy them out."""
        role, m = self.role, len(hit_page_ids)
        pending: dict[int, tuple[int, int]] = {}  # layer -> (transfer id, staging slot)

        def start(layer: int) -> None:
            slot = role.alloc_staging(role.staging.pages_for(2, m), timeout_s=self.time_left_s(pr))
            if slot is None:
                self.time_left_s(pr)  # RoomEnded if the wait ran out of the room's time
                raise RuntimeError("no staging room to pull the decode's stored KV")
            self.time_left_s(pr, slot)  # (allocating may have polled the room's failure)
            base = role.staging.descriptor(slot, 1)[0]  # K of the m pages, then V (view_regions)
            local, remote = [], []
            for half, region in enumerate((2 * layer, 2 * layer + 1)):
                for s, d, n in merge_runs(range(m), hit_page_ids):
                    local.append((base + (half * m + s) * self.page_bytes, n * self.page_bytes))
                    remote.append((pr.peer.kv.base_addrs[region] + d * self.page_bytes, n * self.page_bytes))
            role.sync_device()  # the slot's last copy-out has run before the pull lands in it
            tid = role.agent.submit_read(pr.peer.agent_name, local, remote, b"", expires_s=role.expires_s(pr))
            role.expect_transfer(tid)
            pr.in_flight.add(tid)
            pending[layer] = (tid, slot)

        ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> pulled early (`settle`)

        def collect(layer: int):
            tid, slot = pending.pop(layer)
            # Bounded by the room's time left (an ended room: one last look, then the read is aborted).
            ok = role.wait_for_transfer(tid, slot, timeout_s=role.rooms.time_left_s(pr.room))
            pr.in_flight.discard(tid)
            if not ok:  # the slot is the role's now: freed once nothing can land in it
                self.time_left_s(pr)  # RoomEnded if that is why
                raise RuntimeError("pulling the decode's stored KV failed")
            self.time_left_s(pr, slot)
            view = role.staging.view_regions(slot, 2, m)  # [2, m, page_bytes]: K, V
            # Copy out (the layer's "device" copy) before the slot is reused by this layer's send.
            k = view[0].clone().view(self.dtype).view(-1, *self.kv_shape)
            v = view[1].clone().view(self.dtype).view(-1, *self.kv_shape)
            role.staging.free(slot)
            return k.to(self.runner.device), v.to(self.runner.device)

        def finish(layer: int):
            return ready.pop(layer) if layer in ready else collect(layer)

        def settle() -> bool:
            """Take the pulls started ahead out of staging now (a send found no slot with nothing else
            in flight: the pull, started when other writes held the front of the pool, may sit in the
            middle of it). Whether a slot was freed."""
            layers = list(pending)
            for layer in layers:
                ready[layer] = collect(layer)
            return bool(layers)

        def abandon() -> None:  # a failed run: release slots of pulls started ahead
            for tid, slot in pending.values():
                if role.wait_for_transfer(tid, slot, timeout_s=role.rooms.time_left_s(pr.room)):
                    role.staging.free(slot)  # (else the role frees it once the read is released)
                pr.in_flight.discard(tid)
            pending.clear()

        finish.abandon = abandon
        finish.settle = settle
        return start, finish

    # ---- the run ---------------------------------------------------------------------------------
    def run(self, pr, hit_tokens: int, load_hit: tuple, first_send_page: int) -> None:
        """Prefill tokens [hit_tokens, N) of `pr.req` layer by layer and send pages [first_send_page, ...)
        of every layer to the decode; then sample token 1 and send the handoff. Raises on failure."""
        req, ps = pr.req, self.page_size
        num_tokens = req.num_prompt_tokens
        num_pages = -(-num_tokens // ps)
        send_from = first_send_page * ps  # first token of the pages we send
        current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        start, finish = load_hit
        num_layers = len(self.runner.model.layers)

        def load(layer: int):
            current.clear()
            self.time_left_s(pr)
            current[layer] = finish(layer)
            if layer + 1 < num_layers:
                start(layer + 1)  # overlaps with this layer's compute
            return current[layer]

        def emit(layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
            k_hit, v_hit = current[layer]
            k_all = torch.cat((k_hit[send_from:], k_new[max(0, send_from - hit_tokens) :]))
            v_all = torch.cat((v_hit[send_from:], v_new[max(0, send_from - hit_tokens) :]))
            # Into the decode's pool, which holds finite values only (model/attention.py says why: an
            # fp16 overflow left there turns other requests' tokens to garbage).
            k_all = torch.nan_to_num_(k_all, nan=0.0, posinf=0.0, neginf=0.0)
            v_all = torch.nan_to_num_(v_all, nan=0.0, posinf=0.0, neginf=0.0)
            self._send_layer(
                pr, layer, k_all, v_all, first_send_page, num_pages, getattr(finish, "settle", None)
            )

        miss_ids = torch.tensor(req.prompt_token_ids[hit_tokens:], device=self.runner.device)
        positions = torch.arange(hit_tokens, num_tokens, device=self.runner.device)
        with torch.inference_mode():
            try:
                # (inside the try: anything that failed between the first layer's pull and the forward
                # left that pull in flight, unabandoned, and its room and staging slot held for ever)
                start(0)
                hidden = self.runner.model.forward_layerwise(miss_ids, positions, load, emit)
            except Exception:
                getattr(finish, "abandon", lambda: None)()
                raise
            # Every layer went out in time (the last one's write may have taken the room past its
            # deadline): checked before token 1 exists, so a late room fails with its error delivered.
            self.time_left_s(pr)
            logits = self.runner.model.compute_logits(hidden[-1:]).float()
            result = self.runner.sampler(
                logits, [req.sampling_params], [self.runner.generators.get(req.request_id)], [req]
            )
        token = result.token_ids[0]
        req.append_output(token)
        req.num_computed_tokens = num_tokens
        req.first_token_time = req.last_token_time = time.monotonic()
        if result.logprobs[0] is not None:
            req.logprobs.append(TokenLogprob(token, *result.logprobs[0]))
        req.status = RequestStatus.FINISHED_LENGTH
        pr.num_pages_sent = num_pages  # every page went out layer by layer: the last write is the handoff
        self.role.num_pages_sent += max(0, num_pages - first_send_page)  # (the paged lane's count too)
        self.num_runs += 1

    def _send_layer(self, pr, layer: int, k_all, v_all, first_page: int, num_pages: int, settle=None) -> None:
        """Write layer `layer` of tokens [first_page * page_size, N) to the decode, from a staging slot.
        `settle`: the hit source's way to empty its own slots (DE path), tried once if none is free."""
        role, m = self.role, num_pages - first_page
        if m <= 0:
            return
        need = role.staging.pages_for(2, m)
        slot = role.alloc_staging(need, timeout_s=self.time_left_s(pr))
        if slot is None and settle is not None and settle():
            slot = role.alloc_staging(need, timeout_s=self.time_left_s(pr))
        if slot is None:
            self.time_left_s(pr)  # RoomEnded if the wait ran out of the room's time
            raise RuntimeError("no staging room for a layerwise send")
        self.time_left_s(pr, slot)  # (allocating may have polled the room's failure)
        view = role.staging.view_regions(slot, 2, m)  # [2, m, page_bytes]: K, V (packed: m/L slot pages)
        for half, t in enumerate((k_all, v_all)):
            flat = t.reshape(-1).view(torch.uint8)
            dst = view[half].reshape(-1)
            dst[: flat.numel()].copy_(flat)  # the partial last page's tail stays as it was: unread
        base = role.staging.descriptor(slot, 1)[0]
        dst_pages = pr.dst_page_ids[first_page - pr.first_page :]
        local, remote = [], []
        n_dst = len(pr.dst_page_ids)
        for half, region in enumerate((2 * layer, 2 * layer + 1)):
            if pr.staging_offset >= 0:  # the decode scatters from its staging slot [regions, n_dst, page]
                remote_base = (
                    pr.peer.staging_base_addr
                    + pr.staging_offset * len(role.local_kv.base_addrs) * self.page_bytes
                )
                start = first_page - pr.first_page
                local.append((base + half * m * self.page_bytes, m * self.page_bytes))
                remote.append((remote_base + (region * n_dst + start) * self.page_bytes, m * self.page_bytes))
                continue
            for s, d, n in merge_runs(range(m), dst_pages):
                local.append((base + (half * m + s) * self.page_bytes, n * self.page_bytes))
                remote.append((pr.peer.kv.base_addrs[region] + d * self.page_bytes, n * self.page_bytes))
        role.submit_write(pr, local, remote, last=False, staging_slot=slot)

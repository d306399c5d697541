"""What one engine reports about itself to RL rollout managers and operators, under SGLang's names.

Who calls them: slime polls `GET /health_generate` until an engine it launched serves, and after an
`/abort_request` of everything polls `GET /v1/loads` until the engine is idle (it sums each rank's
`num_total_reqs`, or its running + waiting, and, in newer versions, every positive count in the
sections it asks for); tooling reads `GET /get_server_info`. `server/api.py` mounts them on every
engine's app; the router answers them for a cluster (router/routes.py).

* `GET /v1/loads` (`?include=core,memory,queues,disagg,all`; SGLang's `spec`, `lora` and `inflight`
  are taken and add nothing; `?dp_rank=0`): one entry per data-parallel rank (one here). With nothing
  running, its request counts (the totals, running, waiting, and the counts of `queues` and
  `disaggregation`: slime sums every positive number there) are zero and so is the KV in use; the
  capacities (`max_*`, the `memory` section) are not. `num_held_reqs`: requests waiting for a pause to
  end, counted in no total (they run nowhere: a drain check that counted them would never end while
  clients resubmit their aborted requests).
* `GET /get_server_info` (and `/server_info`): the configuration, the version, and `internal_states`.
* `GET /health_generate`: generates one token (a colocated engine) within HEALTH_GENERATE_TIMEOUT_S:
  200, else 503. A paused engine answers 503 at once (it generates nothing until resumed); a PD
  engine cannot generate alone, so it answers for its engine thread (the router's probes the pair).

They read the engine thread's state without a lock: lengths of its containers (one C call each,
atomic under the GIL), a snapshot at most one step stale, as `pd_load` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve.server.protocol import HEALTH_PROBE_PREFIX, APIError, now_iso

HEALTH_GENERATE_TIMEOUT_S = 20.0  # (SGLang's default health-check timeout)
HEALTH_POLL_S = 0.05  # how often /health_generate looks for outputs of other requests
LOAD_SECTIONS = ("core", "memory", "queues", "disagg")
NO_SECTION = ("spec", "lora", "inflight")  # (SGLang's: nothing here to report under them)


def sections_of(include: str) -> set[str]:
    """`include` (comma-separated; "all" or empty for all): the sections asked for. APIError for a
    name that is not one."""
    names = {n.strip() for n in include.split(",") if n.strip()} or {"all"}
    unknown = names - set(LOAD_SECTIONS) - set(NO_SECTION) - {"all"}
    if unknown:
        raise APIError(
            f"unknown include {sorted(unknown)}: choose from {', '.join(LOAD_SECTIONS + NO_SECTION)} or all",
            param="include",
        )
    return set(LOAD_SECTIONS) if "all" in names else names


def status_routes(aengine: AsyncEngine, engine: LLMEngine, pd=None) -> APIRouter:
    """`pd`: the PDContext of a prefill or decode engine (None: colocated)."""
    router = APIRouter()
    role = pd.role_name if pd is not None else "colocated"
    started_s = time.time()
    # (time, tokens generated) at the last load report: its throughput is over the time since then
    last_sample = [time.monotonic(), engine.num_generated_tokens, 0.0]

    def gen_throughput() -> float:
        now, num_tokens = time.monotonic(), engine.num_generated_tokens
        then, before, rate = last_sample
        if now - then >= 0.5:  # (a poll right after another keeps the last figure)
            rate = (num_tokens - before) / (now - then)
            last_sample[:] = [now, num_tokens, rate]
        return rate

    def load_of(sections: set[str]) -> dict:
        sched, pool, kv = engine.scheduler, engine.kv.pool, engine.kv
        page_size = kv.page_size
        num_running, num_waiting = len(sched.running), len(sched.waiting)
        max_tokens = pool.num_pages * page_size
        used_tokens = pool.num_used_pages * page_size
        # Every request this engine serves (streamed to a caller), also those a PD role holds between
        # the scheduler's queues (a decode's KV arriving, a prefill's pages awaiting the decode's ack)
        num_total = max(aengine.num_streams, num_running + num_waiting)
        out = {"dp_rank": 0, "timestamp": now_iso()}
        if "core" in sections:
            out |= {
                "num_running_reqs": num_running,
                "num_waiting_reqs": num_waiting,
                "num_total_reqs": num_total,
                "num_used_tokens": used_tokens,
                "max_total_num_tokens": max_tokens,
                "token_usage": round(used_tokens / max_tokens, 4),
                "gen_throughput": round(gen_throughput(), 3),
                "cache_hit_rate": round(kv.num_hit_tokens / kv.num_query_tokens, 4)
                if kv.num_query_tokens
                else 0.0,
                "utilization": round(num_running / engine.config.scheduler.max_num_seqs, 4),
                "max_running_requests": engine.config.scheduler.max_num_seqs,
                "num_held_reqs": aengine.num_held,
            }
        if "memory" in sections:
            out["memory"] = {
                "num_used_pages": pool.num_used_pages,
                "num_cached_pages": pool.num_cached_pages,
                "num_pages": pool.num_pages,
                "page_size": page_size,
            }
        if "queues" in sections:
            held = aengine.pause_mode in ("in_place", "retract")
            out["queues"] = {"waiting": num_waiting, "paused": len(engine.requests) if held else 0}
        if "disagg" in sections and pd is not None:
            # (counts only: a section's positive numbers read as work in flight to slime)
            out["disaggregation"] = {"mode": role, "num_reqs": pd.load().num_seqs}
        return out

    @router.get("/v1/loads")
    async def loads(include: str = "all", dp_rank: int | None = None):
        sections = sections_of(include)
        if dp_rank not in (None, 0):
            raise APIError(f"dp_rank {dp_rank} does not exist (one rank: 0)", 404, "NotFound", "dp_rank")
        from pdserve import __version__

        return {
            "timestamp": now_iso(),
            "version": __version__,
            "accelerator": engine.config.device,
            "num_accelerators": 1,
            "loads": [load_of(sections)],
        }

    async def server_info() -> dict:
        from pdserve import __version__

        cfg = engine.config
        return {
            "model_path": engine.weights_dir,
            "tokenizer_path": cfg.model,
            "served_model_name": cfg.model_name,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "page_size": engine.kv.page_size,
            "context_length": cfg.scheduler.max_model_len,
            "max_running_requests": cfg.scheduler.max_num_seqs,
            "max_total_num_tokens": engine.kv.pool.num_pages * engine.kv.page_size,
            "chunked_prefill_size": cfg.scheduler.max_num_batched_tokens,
            "disable_radix_cache": not cfg.cache.enable_prefix_caching,
            "disaggregation_mode": "null" if pd is None else role,
            "weight_version": engine.weight_version,
            "version": __version__,
            "internal_states": [
                {
                    "last_gen_throughput": round(gen_throughput(), 3),
                    "startup_time": started_s,
                    "is_paused": aengine.pause_mode is not None,
                    "num_weight_updates": engine.num_weight_updates,
                }
            ],
        }

    router.add_api_route("/get_server_info", server_info, methods=["GET"])
    router.add_api_route("/server_info", server_info, methods=["GET"])

    @router.get("/health_generate")
    async def health_generate():
        if not aengine.alive or engine.weights_lost:
            return JSONResponse({"status": "unhealthy"}, 503)
        if aengine.pause_mode is not None:
            return JSONResponse({"status": "paused"}, 503)
        if engine.released:  # (its memory given back: /wake_up first)
            return JSONResponse({"status": "sleeping"}, 503)
        if pd is not None:  # (a half generates nothing alone: the router's probe runs the pair)
            return Response(status_code=200)
        req, text = aengine.validate(
            {"prompt_token_ids": [0]},
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
            request_id=f"{HEALTH_PROBE_PREFIX}{uuid.uuid4().hex}",
        )

        async def one_token() -> bool:
            async for out in aengine.generate(req, text):
                if out.finished:
                    return len(out.outputs[0].token_ids) == 1
            return False

        # Healthy once the probe has its token, or once any step has produced outputs since the probe
        # came (SGLang's test): behind a full batch of long rollouts the probe itself waits for a
        # slot, and a busy engine answered 503 at the timeout while it generated hundreds of tokens
        # (a review, 2026-12-05; slime's fault monitor restarts an engine on that).
        tic = time.monotonic()
        probe = asyncio.ensure_future(one_token())
        ok = False
        try:
            while time.monotonic() - tic < HEALTH_GENERATE_TIMEOUT_S:
                done, _ = await asyncio.wait({probe}, timeout=HEALTH_POLL_S)
                if done:
                    ok = not probe.cancelled() and probe.exception() is None and probe.result()
                    break
                if aengine.last_output_s > tic and aengine.alive:
                    ok = True
                    break
        finally:
            if not probe.done():  # (its request is aborted on the way out)
                probe.cancel()
                with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                    await probe
        return Response(status_code=200 if ok else 503)

    return router

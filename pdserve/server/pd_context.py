"""Everything a prefill or decode engine runs besides its engine: control channel, transfer agent,
role, and (prefill) the bootstrap server. Built by `pdserve serve --role prefill|decode`.

Threads of a PD engine process: uvicorn's event loop (HTTP), the engine thread (scheduler + role),
the control channel's ZMQ thread, the transfer agent's thread (it alone touches the NIXL agent), and,
on a prefill, the bootstrap server's thread.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import httpx

from pdserve.disagg import bootstrap
from pdserve.disagg.control import ControlChannel
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.pd_common import PDConfig
from pdserve.engine.pd_decode import DecodeRole
from pdserve.engine.pd_load import load_report
from pdserve.engine.pd_prefill import PrefillRole
from pdserve.model.loader import checkpoint_digest
from pdserve.transfer.agent import TransferAgent
from pdserve.transfer.base import tensor_region

log = logging.getLogger(__name__)


def model_identity(engine: LLMEngine, weights_dir: str | None = None) -> str:
    """Which model's KV this is: architecture, vocabulary and the weights' digest (of `weights_dir`,
    default the served ones). The KV store keys its blocks by it (so engines of one model share blocks
    whatever their page size, and a fine-tune with the same shape never reads another's), and it
    begins the PD fingerprint."""
    mc = engine.config.model_config
    return f"{mc.architecture}|v{mc.vocab_size}|w{checkpoint_digest(weights_dir or engine.weights_dir)}"


def layout_fingerprint(engine: LLMEngine, identity: str) -> str:
    """What PD peers compare before exchanging pages: the same model and the same pool layout."""
    return f"{identity}|{engine.runner.kv_cache.layout.fingerprint()}"


class PDContext:
    def __init__(self, engine: LLMEngine, role_name: str, config: PDConfig, host: str = "127.0.0.1") -> None:
        if role_name not in ("prefill", "decode"):
            raise ValueError(f"PD role must be prefill or decode, got {role_name!r}")
        self.role_name = role_name
        self.config = config
        self._route_epoch = 0  # the epoch of this engine's last bootstrap route (`_register_route`)
        name = f"{role_name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.name = name
        self.control = ControlChannel(host, config.cluster_secret, name)
        identity = model_identity(engine)
        self.identity = identity  # the weights served (the router tells engines that missed an update by it)
        fingerprint = layout_fingerprint(engine, identity)
        role_cls = PrefillRole if role_name == "prefill" else DecodeRole
        self.role = role_cls(engine, config, self.control, None, fingerprint)
        # Everything a peer may write to or we may write from: KV pool and staging slots (on the
        # engine's device), handoff slots (host memory).
        regions = [
            *(tensor_region(t) for t in self.role.kv_regions),
            (self.role.handoff.base_addr, self.role.handoff.nbytes),
            tensor_region(self.role.staging.buffer),
        ]
        self.agent = TransferAgent(config.transfer_backend, name, regions)
        self.agent.metadata()  # fail fast if the backend cannot start
        self.traffic = None
        if config.node_dir:
            from pdserve.netem.traffic import NodeConfig, TrafficManager

            self.traffic = TrafficManager(
                NodeConfig(
                    node=config.node,
                    node_dir=config.node_dir,
                    snic_bytes_per_s=config.snic_bytes_per_s,
                    cnic_bytes_per_s=config.cnic_bytes_per_s,
                    engine=name,
                )
            )
            self.agent.traffic = self.traffic
        self.role.agent = self.agent
        self.bootstrap = None
        self.engine = engine
        self._addr_cache: dict[str, tuple[str, float]] = {}  # bootstrap URL -> (control addr, looked up at)
        self._http: httpx.AsyncClient | None = None  # built in the event loop on the first lookup
        self.store = None
        if config.kv_store_dir:
            from pdserve.engine.store_connector import StoreConnector

            self.store = self._open_store(identity)
            self.role.store = StoreConnector(engine, self.store)
        if role_name == "prefill":
            self.bootstrap = bootstrap.BootstrapServer(
                host, config.bootstrap_port, secret=config.cluster_secret
            )
            self._register_route(fingerprint)
            self.bootstrap.start()

    def _open_store(self, identity: str):
        """The KV store of this model identity (its own directory and key chain under the store root)."""
        from pdserve.store.block_store import KVBlockStore
        from pdserve.store.layout import BlockLayout

        layout = BlockLayout.from_kv_layout(
            self.engine.runner.kv_cache.layout, self.config.kv_block_size, model=identity
        )
        store = KVBlockStore(self.config.kv_store_dir, layout, int(self.config.kv_store_gib * (1 << 30)))
        store.traffic = self.traffic
        return store

    def _register_route(self, fingerprint: str) -> None:
        layout = self.engine.runner.kv_cache.layout
        # Strictly newer than the last, whatever the wall clock did: an NTP step back made the route
        # after a weight update "not newer" (StaleRoute), and the update ended as weights lost (a
        # review, 2026-12-04). (Wall time still: a restarted engine's first route must be newer too.)
        self._route_epoch = max(time.time_ns(), self._route_epoch + 1)
        self.bootstrap.register_local(
            bootstrap.RankRoute(
                rank=0,
                world_size=1,
                control_addr=self.control.address,
                layout_fingerprint=fingerprint,
                page_size=layout.page_size,
                kv_dtype=layout.dtype,
                epoch=self._route_epoch,
                engine_name=self.name,
            )
        )

    def on_new_weights(self, identity: str) -> None:
        """Engine thread, right after `LLMEngine.update_weights` loaded a new checkpoint (an RL step).
        The model's identity names the weights, so the KV of the old ones must never meet the new:
        * the role's layout fingerprint changes: a prefill forgets every registered decode (their
          KVRequests fail until they register again, which a decode on the old weights cannot), a
          decode registers again with each prefill (one on the old weights refuses it);
        * the KV store moves to the new identity's directory and key chain (blocks of the old weights
          are never read; queued write-backs finish into the old one first), and the old directory
          is removed (unless `kv_store_keep_old_weights`; the last engine of a cluster to leave it
          removes what the others still wrote there);
        * a prefill's bootstrap route announces the new fingerprint.
        Requests across a pair whose weights differ fail cleanly (503) until both are updated.
        `identity`: the new weights' (`model_identity` of their directory, read before they loaded)."""
        fingerprint = layout_fingerprint(self.engine, identity)
        self.identity = identity
        self.role.new_weights(fingerprint)
        if self.store is not None:
            old, new = self.store, None
            try:
                new = self._open_store(identity)
                self.role.store.retarget(new)  # (waits for the old store's queued writes)
                self.store = new
            except Exception:  # noqa: BLE001 - no store rather than the old weights' blocks
                log.exception("kv store: cannot open the new weights' store; serving without one")
                self.role.store.close()
                self.role.store = self.store = None
                if new is not None:
                    new.close()
            old.close()  # (waits for its reads in flight: those of rooms the update aborted)
            if new is not None and new.dir != old.dir and not self.config.kv_store_keep_old_weights:
                old.remove_files()  # (the same weights again: the same directory, kept)
        if self.bootstrap is not None:
            self._register_route(fingerprint)

    def load(self):
        """This engine's load report (`GET /pd/load`, polled by the router's placement)."""
        return load_report(self.role, self.config.node, self.traffic)

    def info(self) -> dict:
        out = {
            "control_addr": self.control.address,
            "agent": self.agent.agent_name,
            "node": self.config.node,
            "deadline_s": self.config.deadline_s,  # the router bounds its wait for a prefill with it
            "weights_id": self.identity,
            # (the most KV one request may hold here: the router tries a bigger decode for a request a
            # smaller one refused)
            "kv_capacity_tokens": self.engine.kv.pool.num_pages * self.engine.kv.page_size,
        }
        if self.bootstrap is not None:
            out["bootstrap_url"] = self.bootstrap.url
        return out

    # A cached control address is trusted for this long, then asked for again. A prefill that restarts
    # keeps its bootstrap URL (same port) but binds a new control port: cached forever, the old address
    # sent every later Register/KVRequest to a dead socket, so the restarted prefill never got a request
    # (each expired in Bootstrapping). One lookup per prefill per second is nothing next to the requests.
    ADDR_TTL_S = 1.0

    async def control_address_of(self, bootstrap_url: str) -> str:
        """Decode: the prefill's control address, asked of its bootstrap server and cached for
        ADDR_TTL_S; a failed lookup drops the entry (the prefill is down or restarting)."""
        now = time.monotonic()
        cached = self._addr_cache.get(bootstrap_url)
        if cached is not None and now - cached[1] < self.ADDR_TTL_S:
            return cached[0]
        if self._http is None:  # one client for this process's event loop (see bootstrap.lookup)
            self._http = httpx.AsyncClient()
        try:
            route = await bootstrap.lookup(bootstrap_url, rank=0, timeout_s=10.0, client=self._http)
        except Exception:
            self._addr_cache.pop(bootstrap_url, None)
            raise
        addr = route["control_addr"]
        self._addr_cache[bootstrap_url] = (addr, now)
        return addr

    async def aclose(self) -> None:
        """`close`, and the lookup client first (from the event loop it was built in)."""
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        self.close()

    def close(self) -> None:
        if self.store is not None:
            self.role.store.close()
            self.store.close()
        self.agent.close()
        self.control.close()
        if self.traffic is not None:
            if self.agent.alive:  # (its join timed out: a NIXL release may wait up to 30 s for a copy)
                log.warning("pd: transfer agent still stopping; its emulated links are left open")
            else:
                self.traffic.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()

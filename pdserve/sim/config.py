"""Simulator configuration (frozen) and execution modes.

Who uses it: ``pdserve.sim.cluster.ClusterSim`` reads a ``SimConfig``; scenarios and the CLI build them.

Hardware defaults (paper §5, ``../shared/notes/dualpath.md``): g = 8 GPUs per node, each with its own
compute NIC (CNIC) of B = 400 Gbps = 50 GB/s per direction; one storage NIC (SNIC) of s·B = 400 Gbps
per node; host DRAM bandwidth M = 500 GB/s, reads and writes added. NIC rates are given in Gbit/s
(``*_gbps``) as NICs are sold; internally everything is bytes per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.dualpath.cost_model import DS_660B, ModelProfile

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class HardwareConfig:
    gpus_per_node: int = 8
    cnic_gbps: float = 400.0  # per GPU, per direction
    snic_gbps: float = 400.0  # per node, storage reads
    dram_gbytes_per_s: float = 500.0  # per node, reads + writes

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be ≥ 1, got {self.gpus_per_node}")
        for name in ("cnic_gbps", "snic_gbps", "dram_gbytes_per_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):  # also refuses NaN
                raise ValueError(f"{name} must be > 0 and finite, got {v}")

    @property
    def cnic_bytes_per_s(self) -> float:
        return self.cnic_gbps * GBIT

    @property
    def snic_bytes_per_s(self) -> float:
        return self.snic_gbps * GBIT

    @property
    def dram_bytes_per_s(self) -> float:
        return self.dram_gbytes_per_s * 1e9


@dataclass(frozen=True)
class Mode:
    """An execution mode: scheduler policy name + data-path features.

    layerwise: PE streams hit KV layer by layer, overlapping copies with compute (else: load all hit KV
    into HBM, compute, then send, serially, and the batch's KV must fit the PE's HBM).
    oracle: hit KV costs no I/O at all (upper bound).
    """

    name: str
    policy: str
    layerwise: bool
    oracle: bool = False


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("basic", "round_robin", layerwise=False),
        Mode("layerwise", "round_robin", layerwise=True),
        Mode("dual_path", "round_robin_dual", layerwise=True),
        Mode("dualpath", "dualpath", layerwise=True),
        Mode("split", "split", layerwise=True),
        Mode("oracle", "dualpath", layerwise=True, oracle=True),
    )
}
# The paper's ablation order: Basic, + layerwise prefill, + dual-path loading, + scheduler.
ABLATION_ORDER = ("basic", "layerwise", "dual_path", "dualpath")


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ValueError(f"unknown policy/mode {name!r}; known: {sorted(MODES)}")
    return MODES[name]


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster run.

    compute_quota_s: PE batch quota (paper: 300 ms). alpha_read_s / beta_compute_s: α = tokens one SNIC
    reads in this many seconds (paper 3 s), β = tokens one PE computes in this many seconds (paper 5 s).
    submit_us_per_copy / copies_per_submit: host time to post one copy descriptor and how many share a
    doorbell (paper: ~1 µs per RDMA write request; cudaMemcpyAsync 5-7 µs, H200 anchor 8-10 µs).
    prefill_ep_gpus: PE ranks per EP group that run each forward in lockstep (0 = the model profile's
    ``prefill_ep_gpus``; 1 = independent engines). A size that does not divide the PE count is cut to
    the largest one that does (gcd): e.g. DS-660B's EP16 on one prefill node of 8 GPUs runs as EP8,
    which fits an H200's 141 GB (84 GB of weights per GPU); the profile's HBM budget is not re-derived.
    decode_ep_gpus: DE ranks per decode EP group that run each step in lockstep (0 = the model's
    ``decode_ep_gpus``; 1 = independent engines), cut to divide the DE count like ``prefill_ep_gpus``.
    host_buffer_gb: pinned host DRAM per node for KV in flight, GB (0 = the model's
    ``host_buffer_bytes``; ``math.inf`` = unbounded, the model before buffers were counted).
    max_fetch: the router looks at most this many queue-head requests per fetch.
    fetch_interval_s: the router fetches at most this often (10 ms; adds ≤ 10 ms to a TTFT of seconds).
    horizon_s: stop the clock here (online runs); None = run until every agent finished.
    window_s: the SNIC balance metric's window (and every link's byte-count window), s.
    balance_min_util: a window counts in the SNIC balance metric when the SNICs' mean utilization in
    it is at least this (idle tails say nothing about balance).
    record_intervals: keep every link booking (tests only; memory grows with the run).
    all_link_windows: per-window byte counts on every link, not only the SNICs.
    """

    num_prefill_nodes: int = 2
    num_decode_nodes: int = 4
    hw: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelProfile = DS_660B
    mode: str = "dualpath"
    seed: int = 0
    compute_quota_s: float = 0.300
    alpha_read_s: float = 3.0
    beta_compute_s: float = 5.0
    z_factor: float = 1.05
    submit_us_per_copy: float = 1.0
    copies_per_submit: int = 1
    decode_nodes_per_group: int = 1
    prefill_ep_gpus: int = 0
    decode_ep_gpus: int = 0
    host_buffer_gb: float = 0.0
    page_tokens: int = 16
    block_tokens: int = 64
    max_fetch: int = 64
    fetch_interval_s: float = 0.010
    window_s: float = 10.0
    balance_min_util: float = 0.2
    horizon_s: float | None = None
    record_intervals: bool = False
    all_link_windows: bool = False

    def __post_init__(self) -> None:
        if self.num_prefill_nodes < 1 or self.num_decode_nodes < 1:
            raise ValueError("need at least one prefill and one decode node")
        get_mode(self.mode)
        for name in ("prefill_ep_gpus", "decode_ep_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0 (0 = the model's), got {getattr(self, name)}")
        if not self.host_buffer_gb >= 0:
            raise ValueError(f"host_buffer_gb must be ≥ 0 (0 = the model's), got {self.host_buffer_gb}")
        if not (0.0 < self.window_s < math.inf):
            raise ValueError(f"window_s must be > 0 and finite, got {self.window_s}")
        if not (0.0 <= self.balance_min_util <= 1.0):
            raise ValueError(f"balance_min_util must be in [0, 1], got {self.balance_min_util}")
        if not (0.0 <= self.alpha_read_s < math.inf and 0.0 <= self.beta_compute_s < math.inf):
            raise ValueError(
                f"alpha_read_s and beta_compute_s must be ≥ 0 and finite, got {self.alpha_read_s}, {self.beta_compute_s}"
            )
        if self.max_fetch < 1:  # (0 fetched nothing, for ever)
            raise ValueError(f"max_fetch must be ≥ 1, got {self.max_fetch}")
        if not (1.0 <= self.z_factor < math.inf):
            raise ValueError(f"z_factor must be ≥ 1 and finite, got {self.z_factor}")

    @property
    def prefill_ep_group(self) -> int:
        """PE ranks per lockstep EP group as run: the config's or the model's size, cut to divide the PE
        count (see ``prefill_ep_gpus``)."""
        return _ep_group(
            self.prefill_ep_gpus, self.model.prefill_ep_gpus, self.num_prefill_nodes * self.hw.gpus_per_node
        )

    @property
    def decode_ep_group(self) -> int:
        """DE ranks per lockstep decode group as run (see ``decode_ep_gpus``)."""
        return _ep_group(
            self.decode_ep_gpus, self.model.decode_ep_gpus, self.num_decode_nodes * self.hw.gpus_per_node
        )

    @property
    def host_buffer_bytes(self) -> float:
        """Host buffer per node as run, bytes (the config's size, or the model's)."""
        if self.host_buffer_gb > 0:
            return self.host_buffer_gb * 1e9
        return float(self.model.host_buffer_bytes)


def _ep_group(asked: int, model_size: int, num_gpus: int) -> int:
    """The EP group size as run: the one asked for (0 = the model's), cut to divide ``num_gpus``."""
    return math.gcd(max(asked if asked > 0 else model_size, 1), num_gpus)

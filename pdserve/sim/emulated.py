"""Scenario `emulated`: the simulator run of `pdserve bench dualpath`'s emulated cluster (issue 6's
sim-vs-real check).

Same shape: 1 prefill node and 2 decode nodes with one engine each (g = 1), storage NICs of
`--snic-mbps` (default 8 MB/s) and compute NICs of `--cnic-mbps` (200 MB/s) expressed in Gbit/s for
the simulator; the same agents (the bench's `build_agents` with its defaults: Table-2 32K row, 16 agents,
≤ 12 turns, lengths × 0.2, ≤ 3,500 tokens of context; all start at t = 0); the demo checkpoint's KV
(4 layers x 2 x 4 heads x 32 dims x fp32 = 4 KiB per token; the store file's 4 KiB header per 64-token
block, +1.6% of the storage NICs' bytes, is not modelled). The
real Basic (`round_robin`: PE reads, layerwise prefill) is the simulator's `layerwise` mode; `dualpath`
is `dualpath`.

Compute: the demo model on this machine's CPU (`CPU_DEMO`, below), measured with pdserve's own
engine on a quiet 2-core box (one process; in the emulated cluster three engine processes share the
two cores, which the simulator does not model: see docs/benchmarks.md for the effect).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pdserve.bench.workloads import Workload, _assemble
from pdserve.dualpath.cost_model import QWEN_32B, ModelProfile
from pdserve.sim.config import HardwareConfig, SimConfig

MB_PER_S_TO_GBPS = 8 / 1000  # 1 MB/s = 8 Mbit/s = 0.008 Gbit/s

# The demo checkpoint (pdserve make-demo-model) served in fp32 on CPU by one engine process.
# Measured on this machine (quiet, one process; `python /tmp/prof.py`-style runs recorded in
# docs/benchmarks.md): prefill ≈ 0.25 ms per new token + 10 ns per (new, context) pair, 5 ms per
# batch; decode step ≈ 12 ms + 1 ms per sequence + KV reads at ~4 GB/s.
CPU_DEMO = replace(
    QWEN_32B,
    name="demo-cpu",
    num_layers=4,
    kv_bytes_per_token_layer=1024,
    prefill_s_per_new_token=2.5e-4,
    attn_s_per_pair=1.0e-8,
    prefill_batch_overhead_s=0.005,
    decode_step_overhead_s=0.012,
    decode_s_per_seq=0.001,
    decode_attn_bytes_per_ctx_token=4096.0,
    decode_hbm_bytes_per_s=4e9,
    prefill_hbm_kv_bytes=int(1e9),
    decode_hbm_kv_bytes=int(0.5 * (1 << 30)),
    model_cnic_bytes_per_prefill_token=0.0,
    model_cnic_bytes_per_decode_token=0.0,
)


def bench_workload(num_agents: int = 16, workload: str = "32k", seed: int = 0) -> Workload:
    """The agents `pdserve bench dualpath` replays (same builder, same defaults), as a sim Workload."""
    from pdserve.bench.agentic import WorkloadConfig, build_agents

    agents = build_agents(
        WorkloadConfig(
            workload=workload,
            num_agents=num_agents,
            max_turns=12,
            length_scale=0.2,
            max_context_tokens=3500,
            vocab_size=4096,
            seed=seed,
        )
    )
    return _assemble(
        f"bench-{workload}",
        [np.array([len(t.append_ids) for t in a.turns], dtype=np.int64) for a in agents],
        [np.array([t.gen_tokens for t in a.turns], dtype=np.int64) for a in agents],
        np.zeros(len(agents)),
    )


def emulated(ov, progress):
    from pdserve.sim.scenarios import ScenarioResult, _bar_plot, _knobs, _new_sim, _one, _pick, record

    out = ScenarioResult("emulated")
    snic_mbps = _pick(ov.snic_gbps, 8 * MB_PER_S_TO_GBPS) / MB_PER_S_TO_GBPS
    cnic_mbps = _pick(ov.cnic_gbps, 200 * MB_PER_S_TO_GBPS) / MB_PER_S_TO_GBPS
    hw = HardwareConfig(
        gpus_per_node=1,
        snic_gbps=snic_mbps * MB_PER_S_TO_GBPS,
        cnic_gbps=cnic_mbps * MB_PER_S_TO_GBPS,
        dram_gbytes_per_s=_pick(ov.dram_gbytes_per_s, 10.0),
    )
    model: ModelProfile = CPU_DEMO
    agents = _one(ov.agents, 16, "--agents", "emulated")
    wl_name = _pick(ov.workload, "32k")
    wl = bench_workload(agents, wl_name, _pick(ov.seed, 0))
    jct = {}
    for mode in _pick(ov.policy, ("layerwise", "dualpath")):
        progress(mode)
        cfg = SimConfig(
            num_prefill_nodes=_pick(ov.prefill_nodes, 1),
            num_decode_nodes=_pick(ov.decode_nodes, 2),
            hw=hw,
            model=model,
            mode=mode,
            seed=_pick(ov.seed, 0),
            compute_quota_s=_pick(ov.quota_ms, 300.0) / 1e3,
            **({"window_s": 5.0} | _knobs(ov)),  # (5 s: the bench's --sample-s)
        )
        res = _new_sim(cfg, wl, progress).run()  # (as every scenario: memory check, ticks)
        row = record(res, agents=agents, workload=wl_name, snic_mbps=snic_mbps, cnic_mbps=cnic_mbps)
        out.runs.append(row)
        jct[mode] = row["jct_s"]
    if "layerwise" in jct and "dualpath" in jct:
        out.checks.append(
            f"[INFO] simulated DualPath/Basic JCT {jct['layerwise'] / jct['dualpath']:.2f}x (Basic: the"
            " bench's, layerwise round robin)"
        )
    out.plot = lambda runs, plt: _bar_plot(runs, plt, "agents", "jct_s", "JCT (s)", "emulated")
    return out

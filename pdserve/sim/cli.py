"""``pdserve simulate``: run a named scenario, print a table, optionally write JSON and a plot.

Who calls it: ``pdserve/cli.py`` wires ``add_arguments`` and ``run`` to the ``simulate`` sub-command;
``python -m pdserve.sim.cli ...`` works on its own. ``--json OUT`` writes
``{"scenario": NAME, "runs": [...], "checks": [...]}`` with one object per (policy, setting).
List-valued overrides (``--agents``, ``--aps``, ``--policy``, ``--submit-us``) take comma lists; a
scenario that runs one setting refuses a list rather than use its first value. Numbers are checked
here (a node count of 0 or a NIC of 0 Gbit/s is a usage error, not a traceback).

Past 400 lines because every scenario parameter is an override (the issue asks for all of them), each
with its range and help in one argparse group; the rest (table, JSON, plot, progress) is short.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path

from pdserve.argtypes import make_parent, number, output_file, plot_file
from pdserve.sim import accel

_number = number


_positive_int = _number(int, 0, low_ok=False)
_positive = _number(float, 0.0, low_ok=False)
_positive_or_inf = _number(float, 0.0, low_ok=False, inf_ok=True)
_non_negative = _number(float, 0.0, low_ok=True)
# A link rate in Gbit/s: 1 Mbit/s to 10 Pbit/s. Past these the simulator's arithmetic overflows (1e308:
# an infinite int; 1e-300: windows past an index's size) or builds GBs of windows (a review, 2026-12-04).
_link_gbps = _number(float, 1e-3, low_ok=True, high=1e7)
_link_gbytes_per_s = _number(
    float, 1e-3, low_ok=True, high=1e6
)  # (the same for DRAM in GB/s: 1 MB/s to 1 PB/s)


def _list(item: Callable[[str], object]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        values = tuple(item(x.strip()) for x in text.split(",") if x.strip())
        if not values:
            raise argparse.ArgumentTypeError("empty list")
        return values

    return parse


# The and the scheduler's name for Basic's engine choice.
_POLICY_ALIASES = {"round_robin": "basic"}


def _policy(text: str) -> str:
    """A policy name, checked as it is parsed (a bad one in a list failed only when its turn came,
    after the runs before it)."""
    from pdserve.sim.config import MODES

    name = _POLICY_ALIASES.get(text, text)
    if name not in MODES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; known: {', '.join(sorted(MODES))}")
    return name


def _shape(text: str) -> tuple[int, int]:
    """A P/D shape as the paper writes it: "2P1D" -> (2, 1)."""
    p, sep, d = text.strip().upper().removesuffix("D").partition("P")
    if not (sep and p.isdigit() and d.isdigit() and int(p) >= 1 and int(d) >= 1):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shape like 2P1D (prefill nodes P, decode nodes D)"
        )
    return int(p), int(d)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", help="scenario name (see --list)")
    parser.add_argument("--list", action="store_true", help="list scenarios and exit")
    parser.add_argument("--json", metavar="OUT", type=output_file, help="write the runs as JSON to OUT")
    parser.add_argument(
        "--plot",
        metavar="OUT.png",
        type=plot_file,
        help="write the scenario's plot (format by suffix: .png, .svg, .pdf, ...)",
    )
    parser.add_argument(
        "--accel",
        choices=("auto", "on", "off"),
        default="auto",
        help="compiled simulator (mypyc, same source and results, ~2x faster): auto = use a build "
        "that matches the sources if there is one; on = build it first (~30 s once); off = pure Python",
    )
    g = parser.add_argument_group("overrides (default: the scenario's own)")
    g.add_argument("--prefill-nodes", type=_positive_int, help="prefill nodes")
    g.add_argument("--decode-nodes", type=_positive_int, help="decode nodes")
    g.add_argument("--gpus-per-node", type=_positive_int, help="GPUs (and compute NICs) per node")
    g.add_argument("--model", help="named profile (ds-660b, ds-27b, qwen2.5-32b) or an HF config.json path")
    g.add_argument(
        "--workload",
        help="32k, 48k, 64k (Table 2), mooncake, mooncake-synthetic (+ @trace: the trace's arrival"
        " times, not offline / --aps), weka_cc",
    )
    g.add_argument(
        "--agents",
        type=_list(_positive_int),
        help="agent count(s), comma separated (bandwidth-model: per node)",
    )
    g.add_argument("--aps", type=_list(_positive), help="online: agents per second to try, comma separated")
    g.add_argument(
        "--policy",
        type=_list(_policy),
        help="basic (alias round_robin), layerwise, dual_path, dualpath, split, oracle; comma separated",
    )
    g.add_argument("--snic-gbps", type=_link_gbps, help="storage NIC per node, Gbit/s (default 400)")
    g.add_argument("--cnic-gbps", type=_link_gbps, help="compute NIC per GPU, Gbit/s (default 400)")
    g.add_argument(
        "--dram-gbytes-per-s",
        type=_link_gbytes_per_s,
        help="host DRAM bandwidth per node, GB/s (default 500)",
    )
    g.add_argument("--seed", type=_number(int, 0, low_ok=True), help="workload seed")
    g.add_argument("--quota-ms", type=_positive, help="PE compute quota per batch (default 300)")
    g.add_argument(
        "--submit-us", type=_list(_non_negative), help="per-copy submit µs (submit-cost sweep values)"
    )
    g.add_argument("--copies-per-submit", type=_positive_int, help="descriptors per doorbell (default 1)")
    g.add_argument(
        "--prefill-ep-gpus",
        type=_positive_int,
        help="PE ranks per EP group that step in lockstep (default: the model's; 1 = independent engines;"
        " cut to a divisor of the prefill GPU count)",
    )
    g.add_argument(
        "--decode-ep-gpus",
        type=_positive_int,
        help="DE ranks per decode EP group that step in lockstep (default: the model's; 1 = independent"
        " engines; cut to a divisor of the decode GPU count)",
    )
    g.add_argument(
        "--host-buffer-gb",
        type=_positive_or_inf,
        help="pinned host buffer per node for KV in flight, GB (default: the model's, 80 for DS, 320 for"
        " Qwen; inf = unbounded)",
    )
    g.add_argument("--horizon-s", type=_positive, help="online: simulated seconds per run (default 3600)")
    g.add_argument(
        "--warmup-s",
        type=_non_negative,
        help="online: seconds left out of the figures (default: half the horizon)",
    )
    g.add_argument("--slo-ttft-s", type=_positive, help="online: mean TTFT bound of the SLO, s (default 4)")
    g.add_argument(
        "--slo-tpot-ms", type=_positive, help="online: mean TPOT bound of the SLO, ms (default 50)"
    )
    g.add_argument(
        "--scale-factor",
        type=_positive_int,
        help="scale: the large run's nodes and agents x this (default 24)",
    )
    g.add_argument(
        "--shapes",
        type=_list(_shape),
        help="P/D sweeps (pd-ratio, bandwidth-model, split): the shapes, comma separated (e.g. 1P1D,2P1D)",
    )
    g.add_argument(
        "--window-s",
        type=_number(float, 0.1, low_ok=True, high=1e6),
        help="SNIC balance window, s (default 10, emulated 5; also every link's byte windows; at least 0.1:"
        " each link keeps one count per window)",
    )
    g.add_argument(
        "--balance-min-util",
        type=_number(float, 0.0, low_ok=True, high=1.0),
        help="SNIC balance: a window counts when the SNICs' mean utilization is at least this (default 0.2)",
    )
    g.add_argument("--alpha-read-s", type=_non_negative, help="scheduler α: read-queue seconds (default 3)")
    g.add_argument("--beta-compute-s", type=_non_negative, help="scheduler β: compute seconds (default 5)")
    g.add_argument(
        "--z-factor",
        type=_number(float, 1.0, low_ok=True),
        help="scheduler Z: a DE is low-token below this x the group's mean tokens (default 1.05)",
    )


def _overrides(args: argparse.Namespace):
    from pdserve.sim.scenarios import Overrides

    return Overrides(
        prefill_nodes=args.prefill_nodes,
        decode_nodes=args.decode_nodes,
        gpus_per_node=args.gpus_per_node,
        model=args.model,
        workload=args.workload,
        agents=args.agents,
        aps=args.aps,
        policy=args.policy,
        snic_gbps=args.snic_gbps,
        cnic_gbps=args.cnic_gbps,
        dram_gbytes_per_s=args.dram_gbytes_per_s,
        seed=args.seed,
        quota_ms=args.quota_ms,
        submit_us=args.submit_us,
        copies_per_submit=args.copies_per_submit,
        prefill_ep_gpus=args.prefill_ep_gpus,
        decode_ep_gpus=args.decode_ep_gpus,
        host_buffer_gb=args.host_buffer_gb,
        horizon_s=args.horizon_s,
        warmup_s=args.warmup_s,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_ms=args.slo_tpot_ms,
        scale_factor=args.scale_factor,
        shapes=args.shapes,
        window_s=args.window_s,
        balance_min_util=args.balance_min_util,
        alpha_read_s=args.alpha_read_s,
        beta_compute_s=args.beta_compute_s,
        z_factor=args.z_factor,
    )


_COLUMNS = (
    "policy",
    "shape",
    "agents",
    "aps",
    "submit_us_per_copy",
    "p_over_d",
    "jct_s",
    "jct_mean_s",
    "speedup_vs_basic",
    "jct_change_pct",
    "ttft_p50_s",
    "ttft_mean_s",
    "tpot_p50_s",
    "snic_max_over_avg",
    "attn_max_over_avg",
    "pe_buffer_peak_gb",
    "de_buffer_peak_gb",
    "bottleneck",
    "max_aps",
    "wall_s",
)


def _print_table(name: str, runs: list[dict], checks: list[str]) -> None:
    cols = [c for c in _COLUMNS if any(c in r and r[c] is not None for r in runs)]
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"scenario {name}")
        for c in cols:
            t.add_column(c, justify="right")
        for r in runs:
            t.add_row(*[_fmt(r.get(c)) for c in cols])
        con = Console(width=220)
        con.print(t)
        for c in checks:
            con.print(c, markup=False)
    except ImportError:  # rich is a dependency, but keep plain output possible
        print("  ".join(cols))
        for r in runs:
            print("  ".join(_fmt(r.get(c)) for c in cols))
        for c in checks:
            print(c)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _ep_cut_notes(args: argparse.Namespace, runs: list[dict]) -> Iterator[str]:
    """A note per run in which an EP size asked for was cut to divide the GPU count (the size as run is
    in the JSON, but a table without the column would not show it)."""
    for side in ("prefill", "decode"):
        asked = getattr(args, f"{side}_ep_gpus", None)
        for r in runs:
            ran = r.get(f"{side}_ep_gpus")
            if asked is None or ran is None or ran == asked or f"{side}_nodes" not in r:
                continue
            gpus = r[f"{side}_nodes"] * r["gpus_per_node"]
            yield (
                f"note: --{side}-ep-gpus {asked} ran as {ran} on {r[f'{side}_nodes']} {side} nodes"
                f" ({gpus} GPUs): a group size is cut to divide the GPU count, gcd({asked}, {gpus})"
            )


def _weights_notes(runs: list[dict]) -> Iterator[str]:
    """A note per run whose EP groups could not hold a named profile's weights (``record`` says which)."""
    return (f"note: {r['weights_do_not_fit']}" for r in runs if "weights_do_not_fit" in r)


def _buffer_notes(runs: list[dict]) -> Iterator[str]:
    """A note per run whose host buffers held more than their size: a node whose buffer is empty takes one
    request whatever its size (else a request larger than the buffer would wait for ever)."""
    for r in runs:
        size = r.get("host_buffer_gb")
        peak = max(r.get("pe_buffer_peak_gb") or 0, r.get("de_buffer_peak_gb") or 0)
        if size is not None and peak > size * (1 + 1e-9):
            yield (
                f"note: host buffers of {size:g} GB held up to {peak:g} GB: a request larger than the buffer"
                " enters an empty one alone (it would wait for ever otherwise)"
            )


class _BarProgress:
    """The bar's postfix: the running setting, then its simulated clock and turns done (a 48P96D run
    takes a minute or more; without them the bar stood still)."""

    REFRESH_S = 0.5  # at most this often (a log file gets every redraw)

    def __init__(self, bar) -> None:
        self.bar = bar
        self.label = ""
        self.next_refresh = 0.0

    def __call__(self, label: str) -> None:
        if self.bar.n or self.label:
            self.bar.update(1)
        self.label = label
        self.bar.set_postfix_str(label)

    def tick(self, t_s: float, num_turns_done: int, num_turns: int) -> None:
        now = time.monotonic()
        if now >= self.next_refresh:
            self.next_refresh = now + self.REFRESH_S
            self.bar.set_postfix_str(f"{self.label}: t={t_s:,.0f} s, {num_turns_done:,}/{num_turns:,} turns")


def _use_accel(mode: str) -> str:
    """Switch to the compiled simulator per ``--accel``; returns what runs (for the log line)."""
    if mode == "off":
        return "pure Python (--accel off)"
    try:
        if mode == "on":
            accel.build()
        if accel.activate():
            return f"compiled (mypyc, {accel.build_dir()})"
    except accel.AccelError as e:
        if mode == "on":
            raise
        return f"pure Python ({str(e).splitlines()[0]})"
    return "pure Python (no compiled build for these sources: `make sim-accel` or --accel on)"


def run(args: argparse.Namespace) -> int:
    try:
        engine = _use_accel(getattr(args, "accel", "auto"))
    except accel.AccelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from pdserve.sim.scenarios import SCENARIOS

    if args.list or not args.scenario:
        if not args.list:
            print("error: --scenario NAME is required; the scenarios:", file=sys.stderr)
        for s in SCENARIOS.values():
            print(f"{s.name:16s} {s.description}", file=sys.stdout if args.list else sys.stderr)
        return 0 if args.list else 2
    if args.scenario not in SCENARIOS:
        print(f"unknown scenario {args.scenario!r}; use --list", file=sys.stderr)
        return 2
    sc = SCENARIOS[args.scenario]
    if args.json and args.plot and Path(args.json).absolute() == Path(args.plot).absolute():
        print(
            "error: --json and --plot name the same file (the plot would overwrite the JSON)", file=sys.stderr
        )
        return 2
    overrides = _overrides(args)
    if unused := sc.unused(overrides):
        print(f"error: {sc.name} does not use {', '.join(unused)}", file=sys.stderr)
        return 2
    print(f"simulator: {engine}", file=sys.stderr)
    from tqdm import tqdm

    bar = tqdm(total=sc.num_runs_hint, desc=sc.name, unit="run", file=sys.stderr)
    t0 = time.perf_counter()
    progress = _BarProgress(bar)
    try:
        result = sc.fn(overrides, progress)
    except ValueError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: a traceback from wherever the event loop was said nothing
        bar.close()
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    bar.set_postfix_str(progress.label, refresh=False)  # (not a tick of the last run's middle)
    bar.total = bar.n + 1  # the runs made (the hint is the default setting's count: 3/9 looked cut short)
    bar.update(1)
    bar.close()
    _print_table(sc.name, result.runs, result.checks)
    notes = chain(_ep_cut_notes(args, result.runs), _weights_notes(result.runs), _buffer_notes(result.runs))
    for note in dict.fromkeys(notes):  # (each once: a scenario's runs often share a setting)
        print(note, file=sys.stderr)
    print(f"total wall {time.perf_counter() - t0:.1f} s")
    # (a write that fails -- a full disk, /proc -- is an error line, and the other output is still
    # written: it was a traceback after the run, and the rest lost; a review, 2026-12-04)
    rc = 0
    if args.json:
        payload = {
            "scenario": sc.name,
            "simulator": "compiled (mypyc)" if accel.active() else "pure Python",
            "runs": result.runs,
            "checks": result.checks,
        }
        try:
            Path(make_parent(args.json)).write_text(json.dumps(payload, indent=1))
        except OSError as e:
            print(f"error: cannot write {args.json}: {e}", file=sys.stderr)
            rc = 2
    if args.plot and result.plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = result.plot(result.runs, plt)
        fig.tight_layout()
        try:
            fig.savefig(make_parent(args.plot), dpi=110)
        except OSError as e:
            print(f"error: cannot write {args.plot}: {e}", file=sys.stderr)
            rc = 2
        plt.close(fig)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve simulate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

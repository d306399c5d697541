"""Links (NICs, DRAM) as FIFO fluid servers with per-window byte accounting.

Who uses it: ``ClusterSim`` books every KV byte that moves on every link it crosses. A booking at time
t of b bytes starts at max(t, busy_until) and lasts b / rate; so bookings on one link never overlap
and a link never carries more than ``rate`` bytes per second in any window (tested). Bookings are
made only for the present (never for a future start time chosen by the caller), so one long transfer
does not block unrelated later traffic more than it physically would.

Two traffic classes: model traffic (EP all-to-all; high priority) is not simulated byte by byte; each
link reserves ``model_fraction`` of its capacity for it (the expected model load, derived from the
profile), and KV traffic gets the rest, never less than 1% (the 99:1 weighted arbitration: KV never
starves and never delays model traffic). So KV + model ≤ capacity in every window.
"""

from __future__ import annotations

KV_MIN_SHARE = 0.01  # 99:1 weighted round robin (paper §5: ~99% to high priority)


class Link:
    __slots__ = (
        "name",
        "capacity",
        "rate",
        "busy_until",
        "bytes_total",
        "window_s",
        "windows",
        "intervals",
        "_keep_windows",
    )

    def __init__(
        self,
        name: str,
        capacity_bytes_per_s: float,
        window_s: float,
        model_fraction: float = 0.0,
        record: bool = False,
        windows: bool = True,
    ) -> None:
        self.name = name
        self.capacity = capacity_bytes_per_s
        share = max(1.0 - model_fraction, KV_MIN_SHARE)
        self.rate = capacity_bytes_per_s * share  # bytes/s available to KV
        self.busy_until = 0.0
        self.bytes_total = 0.0
        self.window_s = window_s
        self.windows: list[float] = []  # KV bytes per window (kept only if ``windows``)
        self._keep_windows = windows
        self.intervals: list[tuple[float, float, float]] | None = [] if record else None

    def book(self, t: float, num_bytes: float) -> float:
        """Carry ``num_bytes`` starting no earlier than t; returns the end time."""
        if num_bytes <= 0:
            return t
        start = self.busy_until if self.busy_until > t else t
        end = start + num_bytes / self.rate
        self.busy_until = end
        self.bytes_total += num_bytes
        if self._keep_windows:
            self._account(start, end, num_bytes)
        if self.intervals is not None:
            self.intervals.append((start, end, num_bytes))
        return end

    def _account(self, start: float, end: float, num_bytes: float) -> None:
        w = self.window_s
        first = int(start // w)
        last = int(end // w)
        windows = self.windows
        if last >= len(windows):
            windows.extend([0.0] * (last + 1 - len(windows)))
        if first == last:
            windows[first] += num_bytes
            return
        rate = num_bytes / (end - start)
        windows[first] += ((first + 1) * w - start) * rate
        for i in range(first + 1, last):
            windows[i] += w * rate
        windows[last] += (end - last * w) * rate

    def utilization(self, horizon_s: float) -> float:
        """Mean KV utilization of the capacity over [0, horizon)."""
        return self.bytes_total / (self.capacity * horizon_s) if horizon_s > 0 else 0.0


def book3(a: Link, b: Link, c: Link, t: float, num_bytes: float) -> float:
    """``max(a.book(t, n), b.book(t, n), c.book(t, n))`` in one call (the simulator's hot path: every
    KV copy crosses three links). Same arithmetic as ``Link.book``, so the same floats."""
    if num_bytes <= 0:
        return t
    end = t
    for link in (a, b, c):
        start = link.busy_until if link.busy_until > t else t
        e = start + num_bytes / link.rate
        link.busy_until = e
        link.bytes_total += num_bytes
        if link._keep_windows:
            link._account(start, e, num_bytes)
        if link.intervals is not None:
            link.intervals.append((start, e, num_bytes))
        if e > end:
            end = e
    return end

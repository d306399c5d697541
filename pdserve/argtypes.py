"""Range-checked argparse types, shared by `pdserve` and `pdserve simulate`: a bad value is a usage
error before anything loads (not an OverflowError after the model loaded, a 2-page pool, a value
read as "unset", or a simulation that ran before the mistake was found)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(
    kind: type, low: float, low_ok: bool, inf_ok: bool = False, high: float | None = None
) -> Callable[[str], float]:
    """A finite ``kind`` number above ``low`` (or equal to it when ``low_ok``), at most ``high``;
    ``inf`` only when ``inf_ok`` (an unbounded buffer; an infinite rate, size or horizon means nothing)."""
    bound = f"{'≥' if low_ok else '>'} {low:g}"
    bound += f" and ≤ {high:g}" if high is not None else ("" if inf_ok else " and finite")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if (
            math.isnan(v)
            or v < low
            or (v == low and not low_ok)
            or (math.isinf(v) and not inf_ok)
            or (high is not None and v > high)
        ):
            raise argparse.ArgumentTypeError(f"{text} must be {bound}")
        return v

    parse.is_number = True  # type: ignore[attr-defined]  # (for tests that scan options for addresses)
    return parse

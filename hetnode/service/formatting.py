"""Numbers as people write them, for what a person reads: the `hetnode status` table and the coordinator's
status page. Light on purpose (the standard library only): the table is printed without loading torch."""

from __future__ import annotations

import math
from typing import Any


def format_mbit(value: Any) -> str:
    """A link rate in Mbit/s as people write it: "1000", "12.5", "0.25" (never "1e+03"); "-" if unknown."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10 or value == 0:
        return f"{value:.1f}".removesuffix(".0")
    if value >= 0.01:
        return f"{value:.2f}".rstrip("0").rstrip(".")
    return "<0.01"

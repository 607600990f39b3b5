"""The aggregation rules' names, apart from their math (`aggregate.py`), so that a command line can offer
them as choices without loading torch."""

from __future__ import annotations

import typing
from typing import Literal

AggregationRule = Literal["selectors", "mean", "pooled", "clip", "trimmed"]
AGGREGATION_RULES: tuple[str, ...] = typing.get_args(AggregationRule)

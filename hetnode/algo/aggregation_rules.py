"""The aggregation rules' names and the bound on a contribution's weight, apart from their math
(`aggregate.py`), so that a command line and the seal's schema can use them without loading torch."""

from __future__ import annotations

import typing
from typing import Literal

AggregationRule = Literal["selectors", "mean", "pooled", "clip", "trimmed"]
AGGREGATION_RULES: tuple[str, ...] = typing.get_args(AggregationRule)
MAX_WEIGHT = 1024  # the most weight one contribution may carry in a seal (earned by verified history)

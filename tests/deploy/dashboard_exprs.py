"""Read the PromQL out of a Grafana dashboard JSON, and the metric names out of PromQL.

Shared by the static checks here and the integration test that evaluates every expression against a real
Prometheus scraping a swarm (which imports this file by path, so it imports nothing from the tests).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# PromQL words that look like identifiers but are not metric names (functions are caught by the "(").
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(?![\w:]|\s*\()")


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


def dashboard_exprs(path: Path) -> list[tuple[str, str]]:
    """(panel title, expr) for every Prometheus target of every panel, in dashboard order."""
    dashboard = json.loads(Path(path).read_text())
    return [
        (panel.get("title", ""), target["expr"])
        for panel in iter_panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers outside strings, matchers, ranges and label lists
    that are not functions, aggregations or keywords."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _LABEL_LIST.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in KEYWORDS}

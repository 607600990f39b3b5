"""Imports point one way down the layer table of STYLE.md; hivemind stays inside hetnode/net/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer -> hetnode layers it may import (besides itself, hetnode.config and hetnode.errors)
ALLOWED = {
    "algo": set(),
    "planning": {"algo"},  # plain-number statistics (`algo.quantiles`)
    "model": {"algo"},
    "data": set(),
    "wire": {"algo"},
    "training": {"algo", "model", "data", "replica"},  # a `hetnode train` run writes θ as checkpoints do
    "replica": {"algo", "model", "wire"},
    "sim": {"algo", "model", "data", "training", "wire", "planning"},
    "net": {"wire"},
    "service": {"net", "wire", "model", "algo"},
    "daemon": {"algo", "model", "data", "training", "planning", "wire", "replica", "net", "service"},
    "cli": {
        "algo",
        "model",
        "data",
        "training",
        "planning",
        "wire",
        "replica",
        "net",
        "service",
        "daemon",
        "sim",
        "bench",
        "demo",
        "export",
    },
    "bench": {"algo", "model", "data", "training", "wire", "replica", "sim", "planning"},
    "demo": {"bench", "daemon", "service", "wire"},
    "export": {"model", "data", "replica", "service"},  # its bounded HTTP client (`service.http_download`)
}
SHARED = {"config", "errors", "__init__"}
PURE = {"algo", "planning", "model", "wire", "data", "replica"}  # no I/O libraries, no network stacks


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _layer(path: Path) -> str | None:
    parts = path.relative_to(ROOT / "hetnode").parts
    return parts[0].removesuffix(".py") if len(parts) > 1 or parts[0] == "cli.py" else None


def test_layers_import_only_downwards():
    bad = []
    for path in sorted((ROOT / "hetnode").rglob("*.py")):
        layer = _layer(path)
        if layer is None:
            continue
        assert layer in ALLOWED, f"{path}: layer {layer!r} is not in the layer table"
        for name in _imports(path):
            if not name.startswith("hetnode."):
                continue
            target = name.split(".")[1]
            if target not in SHARED and target != layer and target not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_hivemind_only_in_net():
    offenders = []
    for top in ("hetnode", "bootstrap"):
        for path in (ROOT / top).rglob("*.py"):
            uses = any(n == "hivemind" or n.startswith("hivemind.") for n in _imports(path))
            if uses and not path.is_relative_to(ROOT / "hetnode" / "net"):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_pure_layers_do_no_networking():
    forbidden = {"socket", "asyncio", "msgpack", "hivemind", "http", "urllib", "requests"}
    for path in (ROOT / "hetnode").rglob("*.py"):
        if _layer(path) in PURE - {"wire"}:
            used = {n.split(".")[0] for n in _imports(path)} & forbidden
            assert not used, f"{path}: {used}"

"""Imports point one way down the layer table of STYLE.md; hivemind stays inside hetnode/net/."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# layer -> layers it may import (besides itself, hetnode.config and hetnode.errors); `bootstrap/` is one too
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
    # the swarm protocol the coordinator and the peers share, below both
    "protocol": {"algo", "training", "planning", "wire", "replica", "net", "service"},
    "daemon": {
        "algo",
        "model",
        "data",
        "training",
        "planning",
        "wire",
        "replica",
        "net",
        "service",
        "protocol",
    },
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
        "protocol",
        "daemon",
        "sim",
        "bench",
        "demo",
        "export",
        "lab",
        "bootstrap",  # `hetnode bootstrap` starts the coordinator
    },
    "bench": {"algo", "model", "data", "training", "wire", "replica", "sim", "planning"},
    "demo": {"bench", "daemon", "service", "wire"},
    "export": {"model", "data", "replica", "service"},  # its bounded HTTP client (`service.http_download`)
    # the coordinator: the protocol and what lies below it, never the peer (`daemon`), `cli` or the lab
    "bootstrap": {
        "algo",
        "model",
        "data",
        "training",
        "planning",
        "wire",
        "replica",
        "net",
        "service",
        "protocol",
    },
    # the lab wing: tools that measure or stage a swarm; nothing a volunteer or a coordinator runs imports it
    "lab": {
        "algo",
        "model",
        "data",
        "training",
        "planning",
        "wire",
        "replica",
        "net",
        "service",
        "protocol",
        "daemon",
        "bootstrap",  # the coordinator's verifier and credit rule, measured in process
    },
}
SHARED = {"config", "errors", "__init__", "__version__"}
PURE = {"algo", "planning", "model", "wire", "data", "replica"}  # no I/O libraries, no network stacks


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, type-only and function-level imports included; `from a import b` counts
    as `a` and as `a.b` (b may be a module: `from hetnode import daemon`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _layer(path: Path) -> str | None:
    if path.is_relative_to(ROOT / "bootstrap"):
        return "bootstrap"
    parts = path.relative_to(ROOT / "hetnode").parts
    return parts[0].removesuffix(".py") if len(parts) > 1 or parts[0] == "cli.py" else None


def _target(name: str) -> str | None:
    """The layer an imported module belongs to (None: not ours)."""
    if name == "bootstrap" or name.startswith("bootstrap."):
        return "bootstrap"
    return name.split(".")[1] if name.startswith("hetnode.") else None


def test_layers_import_only_downwards():
    """Every layer of `hetnode/` and `bootstrap/`, checked both ways: `bootstrap/` imports neither the peer
    (`daemon`) nor `cli` nor `lab`; only `cli` and `lab` import `bootstrap/`; only `cli` imports `lab`."""
    bad = []
    for path in sorted([*(ROOT / "hetnode").rglob("*.py"), *(ROOT / "bootstrap").rglob("*.py")]):
        layer = _layer(path)
        if layer is None:
            continue
        assert layer in ALLOWED, f"{path}: layer {layer!r} is not in the layer table"
        for name in _imports(path):
            target = _target(name)
            if target is None:
                continue
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

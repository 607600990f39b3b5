"""Imports (and `python -m` starts) follow the layer table of docs/architecture.md, which this test reads;
hivemind stays inside hetnode/net/; no module imports itself through others."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# what a long-running process builds on: the runtime below the swarm protocol
RUNTIME = {"algo", "model", "data", "training", "planning", "wire", "replica", "net", "service"}
# layer -> layers it may import (besides itself and the shared modules); `bootstrap/` is one too
ALLOWED = {
    "algo": set(),
    "planning": {"algo"},  # plain-number statistics (`algo.quantiles`)
    "model": {"algo"},
    "data": set(),
    "wire": {"algo"},
    # `replica`: a `hetnode train` run writes θ as checkpoints do; `planning`: a round's assigned batches
    "training": {"algo", "model", "data", "replica", "planning"},
    "replica": {"algo", "model", "wire"},
    "net": {"wire"},
    "service": {"net", "wire", "model", "algo"},
    # the swarm protocol the coordinator and the peers share, below both
    "protocol": {"algo", "training", "planning", "wire", "replica", "net", "service"},
    "daemon": RUNTIME | {"protocol"},
    "export": {"model", "data", "replica", "service"},  # its bounded HTTP client (`service.http_download`)
    # the coordinator: the protocol and what lies below it, never the peer (`daemon`), `cli` or the lab
    "bootstrap": RUNTIME | {"protocol"},
    # the lab wing: tools that measure or stage a swarm; nothing a volunteer or a coordinator runs imports it;
    # `bootstrap`: the coordinator's verifier and credit rule, measured in process
    "lab": RUNTIME | {"protocol", "daemon", "bootstrap"},
    # `bootstrap`: `hetnode bootstrap` starts the coordinator
    "cli": RUNTIME | {"protocol", "daemon", "export", "lab", "bootstrap"},
}
SHARED = {"config", "errors", "files", "__init__", "__version__"}
# programs a layer starts as processes (`python -m`), which count as imports but for these, named: the lab
# starts daemons through the command line as a volunteer does
PROCESSES = {"hetnode.cli.main": {"lab"}}
# the one module outside `net/` that imports hivemind: hivemind's own all-reduce, measured as it ships (the
# baseline `hetnode bench network` compares with), run by the lab as a process of its own
HIVEMIND_OUTSIDE_NET = {"hetnode/lab/netbench/allreduce_baseline.py"}
PURE = {"algo", "planning", "model", "wire", "data", "replica"}  # no I/O libraries, no network stacks


def _import_statements(path: Path) -> list[tuple[str, list[str]]]:
    """Each import of `path`, type-only and function-level ones included, as (module, names): `import a.b`
    is ("a.b", []), `from a import b, c` is ("a", ["b", "c"]); a relative import's module keeps its dots."""
    statements = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            statements.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            statements.append((module, [alias.name for alias in node.names]))
    return statements


def _imports(path: Path) -> set[str]:
    """Every module `path` imports; `from a import b` counts as `a` and as `a.b` (b may be a module:
    `from hetnode import daemon`). Modules it starts as processes (`[..., "-m", "hetnode.x", ...]`) are in
    `_started`."""
    names = set()
    for module, imported in _import_statements(path):
        if module.startswith("."):
            continue
        names.add(module)
        names.update(f"{module}.{name}" for name in imported)
    return names


def _started(path: Path) -> set[str]:
    """Our modules `path` starts with `python -m` (an argv list or tuple holding "-m" then the module)."""
    started = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.List | ast.Tuple):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            for flag, module in zip(values, values[1:], strict=False):
                if flag == "-m" and isinstance(module, str) and module.startswith("hetnode."):
                    started.add(module)
    return started


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
        started = {name for name in _started(path) if layer not in PROCESSES.get(name, set())}
        for name in _imports(path) | started:
            target = _target(name)
            if target is None:
                continue
            if target not in SHARED and target != layer and target not in ALLOWED[layer]:
                how = "starts" if name in started else "imports"
                bad.append(f"{path.relative_to(ROOT)} {how} {name}")
    assert not bad, "\n".join(bad)


def test_python_m_strings_count_as_imports(tmp_path: Path):
    program = tmp_path / "starter.py"
    program.write_text(
        'argv = [sys.executable, "-m", "hetnode.daemon.peer", "--x"]\nother = ("-m", "json")\n'
    )
    assert _started(program) == {"hetnode.daemon.peer"}


def _doc_table() -> dict[str, tuple[int, set[str]]]:
    """docs/architecture.md's layer table: layer -> (its row, the layers it may import: the backticked
    names before the first ";" of its third column)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows: dict[str, tuple[int, set[str]]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| `") or len(cells) != 3:
            continue
        name = cells[0].strip("`").removeprefix("hetnode/").rstrip("/")
        rows[name] = (len(rows), set(re.findall(r"`([a-z_]+)`", cells[2].split(";")[0])))
    return rows


def test_the_architecture_doc_and_this_test_agree_row_for_row():
    rows = _doc_table()
    assert set(rows) == set(ALLOWED), set(rows) ^ set(ALLOWED)
    for layer, (row, allowed) in rows.items():
        assert allowed == ALLOWED[layer], (layer, allowed ^ ALLOWED[layer])
        above = [name for name, (other, _) in rows.items() if other < row]
        assert allowed <= set(above), f"{layer} may import a layer below it: {allowed - set(above)}"


def test_hivemind_only_in_net():
    offenders = []
    for top in ("hetnode", "bootstrap"):
        for path in (ROOT / top).rglob("*.py"):
            uses = any(n == "hivemind" or n.startswith("hivemind.") for n in _imports(path))
            inside = path.is_relative_to(ROOT / "hetnode" / "net")
            if uses and not inside and str(path.relative_to(ROOT)) not in HIVEMIND_OUTSIDE_NET:
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders


def test_pure_layers_do_no_networking():
    forbidden = {"socket", "asyncio", "msgpack", "hivemind", "http", "urllib", "requests"}
    for path in (ROOT / "hetnode").rglob("*.py"):
        if _layer(path) in PURE - {"wire"}:
            used = {n.split(".")[0] for n in _imports(path)} & forbidden
            assert not used, f"{path}: {used}"


def _module_name(path: Path) -> str:
    """`hetnode/daemon/peer.py` -> `hetnode.daemon.peer`; a package's `__init__.py` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of `hetnode/` and `bootstrap/` it imports: `from a import b` is an edge to
    `a.b` where that is a module, else to `a`."""
    paths = sorted([*(ROOT / "hetnode").rglob("*.py"), *(ROOT / "bootstrap").rglob("*.py")])
    modules = {_module_name(path): path for path in paths}
    graph = {}
    for module, path in modules.items():
        edges = set()
        for imported, names in _import_statements(path):
            assert not imported.startswith("."), f"{path.relative_to(ROOT)}: a relative import ({imported})"
            if not names:  # `import a.b`
                edges.add(imported)
            edges.update(f"{imported}.{n}" if f"{imported}.{n}" in modules else imported for n in names)
        graph[module] = (edges & modules.keys()) - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """A cycle for every edge back to a module still on the depth-first path (each written from its least
    module, once): none when the graph has no cycle, at least one in every group of modules that reach
    each other (not every circle within a group: fixing those found shows the next)."""
    cycles: set[tuple[str, ...]] = set()
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                cycle = path[path.index(target) :]
                start = cycle.index(min(cycle))
                cycles.add(tuple(cycle[start:] + cycle[:start]))
            elif target not in done:
                visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return [[*cycle, cycle[0]] for cycle in sorted(cycles)]


def test_no_module_imports_itself_through_others():
    """A circle of imports works only in the order Python happens to load it, and keeps its modules from
    being read (or split) one at a time: type-only and function-level imports count as much as the rest."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_finds_a_circle_and_names_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "e2", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


LAB_FILE_LINES = 400  # the lab wing's modules stay small enough to read at once (issue 37)


def test_no_lab_module_is_over_the_line_limit():
    long = {
        str(path.relative_to(ROOT)): n
        for path in (ROOT / "hetnode" / "lab").rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > LAB_FILE_LINES
    }
    assert not long, f"lab modules over {LAB_FILE_LINES} lines (split them by job): {long}"

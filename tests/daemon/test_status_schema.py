"""`hetnode status --json` has exactly the fields, and the types, that docs/status-json.md documents.

The schema is read from the doc's table, so the doc and the code cannot drift apart: a field added to the
document without a row (or a row without a field) fails here. The document is made by `query_status` itself,
with the network replaced (a node that reads the given records), from real peer records."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

import hetnode.daemon.status as status
from hetnode.config import load_config
from hetnode.daemon.swarm import RunContact
from hetnode.net.identity import ephemeral_identity
from hetnode.net.node import StoredValue
from hetnode.net.records import new_peer_record
from hetnode.planning.roles import Candidate, format_layout, pack_chains
from hetnode.protocol.swarm_view import SwarmView
from hetnode.replica.global_model import GlobalModel
from hetnode.wire.manifest import Manifest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "status-json.md"
COORDINATOR = "12D3KooWGRUVh2RNnvh6dquqNn6K7Tq4b1q2nZMB4RVtYfF7bKoF"
MADDR = f"/ip4/127.0.0.1/tcp/31337/p2p/{COORDINATOR}"


def documented_schema() -> dict[str, str]:
    """`field path -> type` from the doc's table (rows like | `peers[].name` | `string` | … |)."""
    rows = re.findall(r"^\| `([a-z_]+(?:\[\]\.[a-z_]+)?)` \| `([^`]+)` \|", DOC.read_text(), re.MULTILINE)
    schema = dict(rows)
    assert len(schema) == len(rows), "a field is documented twice"
    return schema


SCALARS = {"string": str, "int": int, "float": float, "bool": bool, "object": dict}


def type_problem(value: Any, spec: str) -> str:
    """Why `value` is not of the documented type `spec` ("" when it is)."""
    spec = spec.strip()
    if spec.endswith("?"):
        return "" if value is None else type_problem(value, spec[:-1])
    if spec.startswith("list<") and spec.endswith(">"):
        if not isinstance(value, list):
            return f"{value!r} is not a list"
        return next((p for p in (type_problem(v, spec[5:-1]) for v in value) if p), "")
    if spec.startswith("map<string,") and spec.endswith(">"):
        if not isinstance(value, dict):
            return f"{value!r} is not an object"
        if not all(isinstance(k, str) for k in value):
            return f"{value!r} has a key that is not a string"
        return next((p for p in (type_problem(v, spec[11:-1]) for v in value.values()) if p), "")
    expected = SCALARS.get(spec)
    if expected is None:
        raise AssertionError(f"the doc uses a type this test does not know: {spec!r}")
    # JSON has one number type, but the document keeps ints and floats apart; bool is not an int here
    if isinstance(value, bool) != (expected is bool) or not isinstance(value, expected):
        return f"{value!r} is not {spec}"
    return ""


def check_against(document: dict[str, Any], schema: dict[str, str]) -> None:
    top = {path for path in schema if "[]" not in path}
    assert set(document) == top, f"undocumented: {set(document) - top}, missing: {top - set(document)}"
    for path in top:
        assert not type_problem(document[path], schema[path]), (
            path,
            type_problem(document[path], schema[path]),
        )
    for parent in {path.split("[]")[0] for path in schema if "[]" in path}:
        fields = {
            path.split("[].")[1]: spec for path, spec in schema.items() if path.startswith(f"{parent}[].")
        }
        assert document[parent], f"the test swarm should have {parent}"
        for item in document[parent]:
            assert set(item) == set(fields), (
                f"{parent}[]: undocumented {set(item) - set(fields)}, missing {set(fields) - set(item)}"
            )
            for name, spec in fields.items():
                problem = type_problem(item[name], spec)
                assert not problem, f"{parent}[].{name}: {problem}"


def swarm_records(n_layers: int, digests: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A coordinator, an anchor, a live chain of two, a chain missing a stage, an idle peer never measured."""
    ids = {name: ephemeral_identity().peer_id for name in ("anchor", "s0", "s1", "lone", "idle")}
    measured = {"link_class": "low", "up_mbps": 20.0, "down_mbps": 20.0, "rtt_ms": 1.5, "mem_gb": 4.0}
    records = {
        COORDINATOR: new_peer_record(
            "coordinator", link_class="high", role="coordinator", params_round=3, layer_digests=digests
        ),
        ids["anchor"]: new_peer_record(
            "anchor-1",
            **(measured | {"link_class": "high", "up_mbps": 1000.0, "down_mbps": 1000.0}),
            wants="anchor",
            role="anchor",
            layers=[0, n_layers - 1],
            params_round=3,
            layer_digests=digests,
            tokens=40960,
            tflops=0.25,
            utilization=0.93,
        ),
        ids["idle"]: new_peer_record("idle-1"),
    }
    [plan] = pack_chains([Candidate(ids[s], 1.0) for s in ("s0", "s1")], 2, n_layers, 7)
    for stage in plan.stages:
        records[stage.peer_id] = new_peer_record(
            "edge",
            **measured,
            wants="stage",
            role="stage",
            chain=plan.chain,
            stage=stage.stage,
            layers=list(stage.layers),
            chain_layout=format_layout(stage.layout),
            params_round=2,
            layer_digests={k: v for k, v in digests.items() if k in ("embed", "head")},
            tokens=1024,
        )
    lone = plan.stages[0]
    records[ids["lone"]] = new_peer_record(
        "lone",
        **measured,
        wants="stage",
        role="stage",
        chain="c9-0123456789ab",
        stage=0,
        layers=list(lone.layers),
        chain_layout=format_layout(((ids["lone"], *lone.layers),)),
    )
    return records


@pytest.fixture
def status_json(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `hetnode status --json` prints for the swarm of `swarm_records`."""
    config = load_config(ROOT / "configs" / "tiny.toml")
    digests = GlobalModel(config).digests()
    records = swarm_records(config.model.n_layers, digests)
    manifest = Manifest(1, "tiny-0123abcd", config, time.time())

    class Node:
        @classmethod
        async def start(cls, *args: Any, **kwargs: Any) -> Node:
            return cls()

        async def read_field(self, field: str) -> dict[str, StoredValue]:
            assert field == "peers"
            return {peer: StoredValue(peer, value, time.time() + 60) for peer, value in records.items()}

        async def shutdown(self) -> None:
            pass

    async def find_run(node: Any, peer: str, *args: Any, **kwargs: Any) -> RunContact:
        return RunContact(COORDINATOR, manifest)

    async def read_round(node: Any, coordinator: str) -> int:
        return 12  # the boundary

    monkeypatch.setattr(status, "SwarmNode", Node)
    monkeypatch.setattr(status, "find_run", find_run)
    monkeypatch.setattr(status, "read_round", read_round)
    document = asyncio.run(status.query_status(MADDR, 5.0, "/ip4/127.0.0.1/tcp/0"))
    return json.loads(json.dumps(document))  # as the command prints it


def test_the_doc_has_a_schema():
    schema = documented_schema()
    assert {"run", "round", "peers", "chains", "peers[].params_round", "chains[].live"} <= set(schema)


def test_status_json_has_exactly_the_documented_fields_and_types(status_json):
    check_against(status_json, documented_schema())
    roles = [p["role"] for p in status_json["peers"]]
    assert roles == sorted(roles, key=["coordinator", "anchor", "stage", "idle"].index)
    assert {c["live"] for c in status_json["chains"]} == {True, False}
    assert None in next(c["stages"] for c in status_json["chains"] if not c["live"])
    assert status_json["round"] == 12 and status_json["coordinator"] == COORDINATOR


def test_the_checker_refuses_what_the_doc_does_not_say(status_json):
    schema = documented_schema()
    extra = dict(status_json, boundary=12)
    with pytest.raises(AssertionError, match="undocumented"):
        check_against(extra, schema)
    wrong = json.loads(json.dumps(status_json))
    wrong["peers"][0]["params_round"] = "3"
    with pytest.raises(AssertionError, match="params_round"):
        check_against(wrong, schema)
    assert type_problem(True, "int") and type_problem(1, "float") and not type_problem(None, "list<int>?")


def test_the_view_alone_makes_the_peer_and_chain_parts():
    """status_document is the part every caller shares (the CLI adds the top-level fields around it)."""
    config = load_config(ROOT / "configs" / "tiny.toml")
    records = swarm_records(config.model.n_layers, GlobalModel(config).digests())
    entries = {peer: StoredValue(peer, value, time.time() + 60) for peer, value in records.items()}
    view = SwarmView.from_entries(entries, config.pipeline.stages, config.model.n_layers)
    document = view.status_document("tiny-0123abcd", 12)
    schema = documented_schema()
    assert set(document) <= {path for path in schema if "[]" not in path}
    assert len(document["peers"]) == len(records)

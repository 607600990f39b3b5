"""Static checks of the deployment files: docker-compose.yml, the Dockerfile, Prometheus and Grafana configs.

Nothing here starts a container or a daemon. Commands are checked against the real CLI parser, mounts against
the repository, the dashboard against the provisioned datasource and the metric contract
(docs/observability.md), and PromQL and the scrape config with `promtool` where it is installed (it must be in
CI).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hetnode.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
PROMETHEUS = ROOT / "configs" / "prometheus.yml"
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "hetnode.json"
DATASOURCES = ROOT / "configs" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = ROOT / "configs" / "grafana" / "provisioning" / "dashboards" / "hetnode.yml"
EDGE_ENTRYPOINT = ROOT / "configs" / "docker" / "edge-entrypoint.sh"
APP_DIR = "/app"  # the Dockerfile's WORKDIR: the repository's layout under it

_spec = importlib.util.spec_from_file_location(
    "dashboard_exprs", Path(__file__).with_name("dashboard_exprs.py")
)
assert _spec is not None and _spec.loader is not None
dashboard_exprs_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dashboard_exprs_module)
dashboard_exprs = dashboard_exprs_module.dashboard_exprs
iter_panels = dashboard_exprs_module.iter_panels
metric_names = dashboard_exprs_module.metric_names

# docs/observability.md and issue 7: what the daemons export (histograms by their series names).
CONTRACT_METRICS = {
    # every participant
    "hetnode_tokens_processed_total",
    "hetnode_inner_steps_total",
    "hetnode_outer_step",
    "hetnode_train_loss",
    "hetnode_train_tokens_per_second",
    "hetnode_bytes_sent_total",
    "hetnode_bytes_received_total",
    "hetnode_sync_round_seconds_bucket",
    "hetnode_sync_round_seconds_sum",
    "hetnode_sync_round_seconds_count",
    "hetnode_sync_rounds_left_out_total",
    "hetnode_digest_mismatch_total",
    "hetnode_compression_ratio",
    "hetnode_link_mbps",
    "hetnode_peer_info",
    # the coordinator
    "hetnode_swarm_peers",
    "hetnode_swarm_chains",
    "hetnode_rounds_sealed_total",
    "hetnode_global_eval_loss",
    "hetnode_round_contributors",
    "hetnode_round_payload_bytes",
    "hetnode_round_dense_bytes",
    "hetnode_contribution_tokens_total",
    "hetnode_contribution_rounds_total",
    "hetnode_contribution_inner_steps_total",
    "hetnode_contribution_bytes_total",
    "hetnode_contribution_share",
    # verified contributions (issue 16)
    "hetnode_contribution_rejected_total",
    "hetnode_contribution_score",
}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    document = load_yaml(COMPOSE)
    assert isinstance(document, dict) and isinstance(document.get("services"), dict)
    return document


def hetnode_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: s
        for name, s in compose["services"].items()
        if "build" in s or s.get("image") == "hetnode:local"
    }


def hetnode_argv(service: dict[str, Any]) -> list[str]:
    """The arguments `hetnode` gets: the command, run by the image's entrypoint or the edge script."""
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def container_path(host_path: str) -> str:
    """Where a repository path lands in the image (WORKDIR /app, the repository's layout)."""
    return f"{APP_DIR}/{Path(host_path).as_posix()}"


def bind_mounts(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) of a service's bind mounts; named volumes are left out."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts.append((volume["source"], volume["target"]))
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/", "~")):
            mounts.append((source, target))
    return mounts


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        if os.environ.get("CI"):
            pytest.fail(
                "promtool is not installed; CI must install it (Debian/Ubuntu: apt-get install prometheus)"
            )
        pytest.skip("promtool is not installed (install prometheus to run this check)")
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60, check=False)


# --- docker-compose.yml ---------------------------------------------------------------------------


def test_compose_has_the_swarm_and_its_monitoring(compose: dict[str, Any]) -> None:
    services = set(compose["services"])
    expected = {"bootstrap", "anchor-1", "anchor-2", "edge-1", "edge-2", "edge-3", "prometheus", "grafana"}
    assert expected <= services, f"missing services: {sorted(expected - services)}"
    assert set(hetnode_services(compose)) == expected - {"prometheus", "grafana"}


def test_every_hetnode_command_is_accepted_by_the_cli(
    compose: dict[str, Any], capsys: pytest.CaptureFixture
) -> None:
    for name, service in hetnode_services(compose).items():
        argv = hetnode_argv(service)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            refused = f"`hetnode {shlex.join(argv)}` refused ({exc.code})"
            pytest.fail(f"service {name}: {refused}: {capsys.readouterr().err}")
        if args.command == "bootstrap":
            assert (ROOT / args.config).is_file(), (
                f"service {name}: no config {args.config} in the repository"
            )
            assert args.http_host == "0.0.0.0" and args.http_port == 8400, (
                f"service {name}: status page unreachable"
            )
        else:
            assert args.command == "join", f"service {name}: runs {args.command}"
            assert args.name == name, f"service {name} joins as {args.name!r}"
            assert args.metrics_port is not None and args.http_host == "0.0.0.0", (
                f"{name}: metrics unreachable"
            )


def test_edges_shape_their_uplink_and_anchors_declare_theirs(compose: dict[str, Any]) -> None:
    for name, service in hetnode_services(compose).items():
        args = build_parser().parse_args(hetnode_argv(service))
        if name.startswith("edge-"):
            entrypoint = service.get("entrypoint")
            assert entrypoint and entrypoint[-1] == container_path(str(EDGE_ENTRYPOINT.relative_to(ROOT)))
            assert "NET_ADMIN" in service.get("cap_add", []), f"{name}: tc needs NET_ADMIN"
            assert args.bandwidth == "auto", f"{name}: an edge must measure its shaped link"
        elif name.startswith("anchor-"):
            assert float(args.bandwidth) >= 500, f"{name}: an anchor must declare an anchor-class link"
    script = EDGE_ENTRYPOINT.read_text()
    assert "tc qdisc replace dev eth0 root tbf rate" in script and "${EDGE_MBIT:-20}" in script
    assert script.rstrip().splitlines()[-1] == 'exec hetnode "$@"', (
        "the script must hand its arguments to hetnode"
    )


def test_peers_wait_for_a_healthy_coordinator(compose: dict[str, Any]) -> None:
    services = hetnode_services(compose)
    assert "healthz" in json.dumps(services["bootstrap"]["healthcheck"]["test"])
    for name, service in services.items():
        if name != "bootstrap":
            assert service["depends_on"]["bootstrap"]["condition"] == "service_healthy", name


def test_bind_mounted_paths_exist(compose: dict[str, Any]) -> None:
    mounts = [(name, *m) for name, s in compose["services"].items() for m in bind_mounts(s)]
    assert mounts, "expected the configs to be bind-mounted"
    for name, source, _ in mounts:
        assert (ROOT / source).exists(), f"service {name} mounts {source}, which is not in the repository"


def test_entrypoint_scripts_exist_in_the_image(compose: dict[str, Any]) -> None:
    for name, service in hetnode_services(compose).items():
        for arg in service.get("entrypoint") or []:
            if arg.startswith(f"{APP_DIR}/"):
                assert (ROOT / arg.removeprefix(f"{APP_DIR}/")).is_file(), f"service {name}: no {arg}"


def test_prometheus_scrapes_every_metrics_endpoint(compose: dict[str, Any]) -> None:
    expected = set()
    for name, service in hetnode_services(compose).items():
        args = build_parser().parse_args(hetnode_argv(service))
        expected.add(f"{name}:{args.http_port if args.command == 'bootstrap' else args.metrics_port}")
    config = load_yaml(PROMETHEUS)
    assert config["global"]["scrape_interval"] == "5s"
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == expected


def test_grafana_mounts_match_the_provisioning(compose: dict[str, Any]) -> None:
    mounts = dict(bind_mounts(compose["services"]["grafana"]))
    assert mounts["./configs/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert mounts["./configs/grafana/dashboards"] == provider["options"]["path"]
    prometheus = dict(bind_mounts(compose["services"]["prometheus"]))
    assert prometheus["./configs/prometheus.yml"] == "/etc/prometheus/prometheus.yml"


# --- Dockerfile -----------------------------------------------------------------------------------


def test_dockerfile_installs_cpu_torch_before_the_project() -> None:
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    torch = [i for i, line in enumerate(lines) if re.search(r"pip install .*torch==", line)]
    project = [i for i, line in enumerate(lines) if re.search(r"pip install (\S+ )*\.$", line)]
    assert len(torch) == 1 and len(project) == 1, "expected one torch install and one project install"
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch[0]]
    assert torch[0] < project[0], "torch must come first, or pip resolves the open range to a CUDA build"
    makefile_pin = re.search(r"torch==([\w.+]+)", (ROOT / "Makefile").read_text())
    assert makefile_pin and f"torch=={makefile_pin.group(1)} " in lines[torch[0]] + " ", (
        "same pin as Makefile"
    )
    assert any("iproute2" in line for line in lines), "edges need tc"
    assert 'ENTRYPOINT ["hetnode"]' in lines


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "runs"} <= ignored


# --- Grafana dashboard ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_uses_the_provisioned_datasource(dashboard: dict[str, Any]) -> None:
    (datasource,) = load_yaml(DATASOURCES)["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    uid = datasource["uid"]
    assert dashboard["uid"] == "hetnode-swarm" and dashboard["title"] == "hetnode swarm"
    panels = list(iter_panels(dashboard["panels"]))
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"] == {"type": "prometheus", "uid": uid}, panel["title"]


def test_every_panel_queries_contract_metrics(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in iter_panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in iter_panels(dashboard["panels"]):
        exprs = [t.get("expr", "").strip() for t in panel.get("targets", [])]
        assert any(exprs), f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"panel {panel['title']!r}: duplicate refIds"
    for title, expr in dashboard_exprs(DASHBOARD):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr!r}"
        for name in names:
            assert name.startswith("hetnode_"), f"{title}: {name} in {expr!r}"
            assert name in CONTRACT_METRICS, f"{title}: {name} is not an exported series"


def test_dashboard_exprs_work_on_a_small_young_swarm() -> None:
    """No template variables, no windows longer than 2 minutes (5 for histograms), no selectors on label
    values a small swarm may not have (no chain: no subspace ratio, no stage payloads)."""
    exprs = dashboard_exprs(DASHBOARD)
    assert len(exprs) >= 10
    for title, expr in exprs:
        assert "$" not in expr, f"{title}: Grafana variable in {expr!r}"
        assert "{" not in expr, f"{title}: label selector in {expr!r}"
        for amount, unit in re.findall(r"\[(\d+)([smh])\]", expr):
            seconds = int(amount) * {"s": 1, "m": 60, "h": 3600}[unit]
            limit = 300 if "_bucket" in expr else 120
            assert seconds <= limit, f"{title}: window [{amount}{unit}] in {expr!r}"


def test_dashboard_exprs_parse(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"hetnode_dashboard:expr_{i}", "expr": expr}
                    for i, (_, expr) in enumerate(dashboard_exprs(DASHBOARD))
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_metric_names_skips_functions_labels_and_numbers() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (job, le) (rate(a_bucket{kind="x(y)"}[5m]))) '
        "* on (instance) group_left (name) b offset 1m > 1e3 and sum without (le) (c)"
    )
    assert metric_names(expr) == {"a_bucket", "b", "c"}


# --- Prometheus -----------------------------------------------------------------------------------


def test_prometheus_config_passes_promtool() -> None:
    result = run_promtool("check", "config", str(PROMETHEUS))
    assert result.returncode == 0, result.stdout + result.stderr

"""The Prometheus side of docs/operations.md against a real server and Debian's promtool.

* ``/metrics`` of a server that has seen traffic on every kind of series (streams,
  reads, a consumer group, a kind, SQL, an error) passes ``promtool check metrics``,
  scraped with the admin token the documented scrape config uses;
* docs/ops/headwater-alerts.yml passes ``promtool check rules`` and its unit tests
  (``promtool test rules``, tests/integration/prometheus/alerts_test.yml), and every
  headwater metric it names is one the server exports;
* docs/ops/grafana-dashboard.json: every panel query is valid PromQL (checked by
  promtool) over metrics the server exports;
* the scrape config of docs/operations.md ("Metrics and tokens"), as written there,
  passes ``promtool check config`` with the alert rules loaded, and a real Prometheus
  running it scrapes a server with the token (``up`` is 1, headwater's series arrive),
  and once the server stops, the HeadwaterDown alert goes pending.

promtool and prometheus come from Debian's ``prometheus`` package (``make
system-deps``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml
from servers import LOCAL, Server, free_port, serving

import headwater
from headwater import entities
from headwater.errors import StreamNotFound
from waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "docs" / "ops" / "headwater-alerts.yml"
ALERT_TESTS = Path(__file__).parent / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "docs" / "ops" / "grafana-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"

TOKEN = "scrape-0123456789abcdef"
GROUP_LAG = 'headwater_consumer_group_lag{group="billing",partition="0",stream="orders",tenant="0"}'
CONFIG = f"""
[auth]
required = true

[[auth.tokens]]
token = "{TOKEN}"
tenants = [0]
admin = true
"""
# Series the rules may name that are not headwater's: Prometheus's own per target, and
# node_exporter's filesystem gauges (the server does not report free disk space).
FOREIGN_METRICS = {"up", "node_filesystem_avail_bytes", "node_filesystem_size_bytes"}
METRIC_NAME = re.compile(r"\b(?:headwater_[a-z_]+|up|node_[a-z_]+)\b(?!\s*\()")
PROMQL_WORDS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right|and|or|unless)\b")


@dataclass
class Sample:
    metrics_text: str
    exported: set[str]


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: `make system-deps` installs Debian's prometheus"
    return found


def run_promtool(*args: str, stdin: str | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [promtool(), *args], input=stdin, capture_output=True, text=True, timeout=60, cwd=cwd
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def exported_names(metrics_text: str) -> set[str]:
    """Every series name the exposition declares (a histogram's _bucket, _sum, _count)."""
    names: set[str] = set()
    for line in metrics_text.splitlines():
        match = re.match(r"# TYPE (\S+) (\S+)", line)
        if not match:
            continue
        name, kind = match.groups()
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


def scrape(server: Server, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.address_of('http')}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape_showing(server: Server, series: str) -> str | None:
    """/metrics (with the scrape token) once it holds ``series``."""
    status, text = scrape(server, TOKEN)
    assert status == 200, text
    return text if series in text else None


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sample]:
    listen = {"http": LOCAL, "convergedb": LOCAL}
    for server in serving(tmp_path_factory.mktemp("prometheus"), config=CONFIG, listen=listen):
        with headwater.connect(server.address, token=TOKEN) as client:
            client.create_stream("orders")
            client.append("orders", [f"order {i}".encode() for i in range(50)])
            with client.subscribe("orders", 0, group="billing", credits=10) as sub:
                got = 0
                while got < 30:  # credits granted again acknowledge what was delivered
                    got += len(sub.next_batch(timeout=30))
            assert client.query("SELECT count(*) FROM orders").rows == [(50,)]
            with pytest.raises(StreamNotFound):
                client.read("no_such_stream")
        with entities.connect(server.address_of("convergedb"), token=TOKEN) as writer:
            kind = writer.create_kind(Reading, "readings")
            writer.assert_(kind, "r1", Reading(1.5))
            writer.flush()
        status, refused = scrape(server, None)
        assert status == 401, refused  # the scrape needs the token, as documented
        # The group's committed position reaches /metrics once the server has it.
        text = wait_until(
            lambda: scrape_showing(server, GROUP_LAG),  # noqa: B023 (called at once)
            message="the consumer group never showed in /metrics",
        )
        yield Sample(text, exported_names(text))


@dataclass
class Reading:
    value: float


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label values and functions aside)."""
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    without_strings = re.sub(r'"[^"]*"', "", without_labels)
    return set(METRIC_NAME.findall(PROMQL_WORDS.sub(" ", without_strings)))


def alert_exprs() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {
        rule["alert"]: str(rule["expr"]) for group in rules["groups"] for rule in group["rules"]
    }


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        exprs += [target["expr"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((\w+), *\w+\)", query)
            assert inner, query
            exprs.append(inner.group(1))
    return exprs


def test_metrics_of_a_real_server_pass_promtool(sample: Sample) -> None:
    output = run_promtool("check", "metrics", stdin=sample.metrics_text)
    assert output.strip() == "", f"promtool check metrics found problems:\n{output}"
    # The traffic above reached the series the rules and dashboard are about.
    for series in (
        'headwater_append_seconds_bucket{le="+Inf",protocol="kimberlite"}',
        'headwater_kind_entities{kind="readings",tenant="0"}',
        "headwater_errors_total{",
    ):
        assert series in sample.metrics_text


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    output = run_promtool("check", "rules", str(ALERTS))
    assert f"SUCCESS: {len(alert_exprs())} rules found" in output
    output = run_promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert "SUCCESS" in output
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert tested == set(alert_exprs()), "every alert has a unit test"


def test_alert_rules_name_only_metrics_the_server_exports(sample: Sample) -> None:
    named = {name for expr in alert_exprs().values() for name in metric_names(expr)}
    assert "headwater_append_seconds_bucket" in named  # the extraction sees the names
    assert named - sample.exported <= FOREIGN_METRICS, named - sample.exported


def test_grafana_dashboard_queries_are_promql_over_exported_metrics(
    sample: Sample, tmp_path: Path
) -> None:
    exprs = dashboard_exprs()
    named = {name for expr in exprs for name in metric_names(expr)}
    assert named, "no metric found in the dashboard"
    assert named <= sample.exported, named - sample.exported
    # Grafana's variables substituted as Grafana does, then parsed by promtool.
    substituted = [
        expr.replace("$__rate_interval", "1m").replace("$instance", ".*") for expr in exprs
    ]
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:panel_{i}", "expr": expr}
                    for i, expr in enumerate(substituted)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    assert f"SUCCESS: {len(exprs)} rules found" in run_promtool("check", "rules", str(path))


def documented_scrape_configs() -> list[dict[str, Any]]:
    """The YAML blocks of docs/operations.md that hold a headwater scrape job (plain
    HTTP in "Metrics and tokens", HTTPS in "TLS")."""
    blocks = re.findall(r"```yaml\n(.*?)```", OPERATIONS.read_text(), re.S)
    found = [yaml.safe_load(b) for b in blocks if "job_name: headwater" in b]
    assert found, "docs/operations.md has no headwater scrape config"
    return found


def test_documented_scrape_configs_pass_promtool_check_config(tmp_path: Path) -> None:
    token_file = tmp_path / "headwater.token"
    token_file.write_text(TOKEN)
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    for i, config in enumerate(documented_scrape_configs()):
        (job,) = config["scrape_configs"]
        assert job["authorization"]["type"] == "Bearer"
        # The documented paths, on this machine: promtool reads the files named.
        job["authorization"]["credentials_file"] = str(token_file)
        if "tls_config" in job:
            assert job["scheme"] == "https"
            job["tls_config"]["ca_file"] = str(ca_file)
        config["rule_files"] = [str(ALERTS)]
        path = tmp_path / f"prometheus-{i}.yml"
        path.write_text(yaml.safe_dump(config))
        output = run_promtool("check", "config", str(path))
        assert "SUCCESS" in output and f"{len(alert_exprs())} rules found" in output


def prometheus_api(port: int, path: str, **params: str) -> Any:
    query = urllib.parse.urlencode(params)
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + (f"?{query}" if query else "")
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return json.loads(answer.read())["data"]
    except (urllib.error.URLError, ConnectionError):
        return None  # not up yet


def test_prometheus_scrapes_a_server_with_the_documented_config_and_alerts_when_it_stops(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is missing: `make system-deps` installs Debian's prometheus"
    server = make_server(config=CONFIG, listen={"http": LOCAL})
    config = documented_scrape_configs()[-1]  # "Metrics and tokens": plain HTTP
    (job,) = config["scrape_configs"]
    token_file = tmp_path / "headwater.token"
    token_file.write_text(TOKEN)
    job["authorization"]["credentials_file"] = str(token_file)
    job["static_configs"] = [{"targets": [server.address_of("http")]}]
    job["scrape_interval"] = "1s"
    config["global"] = {"evaluation_interval": "1s"}
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (tmp_path / "prometheus.log").open("wb") as log:
        prometheus = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:

        def value_of(query: str) -> float | None:
            data = prometheus_api(port, "query", query=query)
            if not data or not data["result"]:
                return None
            return float(data["result"][0]["value"][1])

        def log_tail() -> str:
            return (tmp_path / "prometheus.log").read_text()[-3000:]

        wait_until(lambda: value_of('up{job="headwater"}') == 1.0, 60, log_tail)
        assert value_of('headwater_uptime_seconds{job="headwater"}') is not None
        assert value_of('count({job="headwater", __name__=~"headwater_.*"})') > 20

        assert server.stop() == 0
        # up turns 0 at the next scrape; the rule (for: 1m) is pending from then on.
        pending = wait_until(
            lambda: [
                alert
                for alert in (prometheus_api(port, "alerts") or {"alerts": []})["alerts"]
                if alert["labels"]["alertname"] == "HeadwaterDown"
            ],
            60,
            log_tail,
        )
        assert pending[0]["state"] == "pending"
        assert pending[0]["labels"]["instance"] == server.address_of("http")
    finally:
        prometheus.terminate()
        prometheus.wait(30)

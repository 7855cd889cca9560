"""The node pool chart (deploy/helm/triton-pool), checked by the tools that run it: helm lints and
renders it in each autoscaling mode; promtool checks its alert and the prometheus-adapter rule
the HPA reads through, on the series the control plane's /metrics exports; and the HPA's own
arithmetic on that series asks for the nodes the product wants."""

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client

from apps.fleet.models import Node, NodePool
from apps.scaling import hpa
from apps.scaling.models import Scaling
from tests.support.metrics import scrape_headers
from tests.support.tools import run, tool

pytestmark = [pytest.mark.integration]

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "triton-pool"


@cache
def rendered(*values: str) -> dict[str, dict[str, Any]]:
    """The chart's objects by kind (one of each at most)."""
    argv = ["template", "p", str(CHART), "--set", "pool=gpu-a"]
    for value in values:
        argv += ["--set", value]
    result = run(tool("helm"), *argv)
    assert result.returncode == 0, result.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(result.stdout) if doc}


@pytest.mark.parametrize(
    "values",
    [(), ("autoscaling.mode=keda", "podMonitor.enabled=true"), ("autoscaling.mode=none",)],
    ids=["hpa", "keda", "fixed"],
)
def test_the_chart_lints_cleanly_in_each_mode(values: tuple[str, ...]) -> None:
    sets = [f"--set={value}" for value in (*values, "alerts.enabled=true")]
    result = run(tool("helm"), "lint", "--strict", str(CHART), *sets)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_unknown_mode_is_refused_by_name() -> None:
    result = run(tool("helm"), "template", "p", str(CHART), "--set", "autoscaling.mode=vpa")
    assert result.returncode != 0
    assert 'autoscaling.mode: hpa, keda or none, not "vpa"' in result.stderr


def test_a_node_starts_with_nothing_loaded_and_is_found_with_the_labels_discovery_reads() -> None:
    objects = rendered("podMonitor.enabled=true")
    assert set(objects) == {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
        "PodMonitor",
    }
    deployment = objects["Deployment"]
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    pod = deployment["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert "--model-control-mode=explicit" in server["args"]
    assert "--model-repository=/models" in server["args"]
    assert server["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert (
        server["startupProbe"]["failureThreshold"] * server["startupProbe"]["periodSeconds"] == 600
    )
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert {m["name"]: m["mountPath"] for m in server["volumeMounts"]}["models"] == "/models"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert (ports["http"], ports["grpc"]) == (
        settings.DISCOVERY_HTTP_PORT,
        settings.DISCOVERY_GRPC_PORT,
    )
    relabel = objects["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["relabelings"]
    targets = {r["targetLabel"]: r["sourceLabels"] for r in relabel}
    assert targets == {
        settings.DISCOVERY_NAME_LABEL: ["__meta_kubernetes_pod_name"],
        settings.DISCOVERY_POOL_LABEL: ["__meta_kubernetes_pod_label_triton_pool"],
    }
    assert deployment["spec"]["template"]["metadata"]["labels"]["triton-pool"] == "gpu-a"
    assert objects["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1
    # Without a PodMonitor, a scrape config finds the pods by their annotations.
    annotations = rendered()["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_keda_reads_the_same_series_with_the_same_behaviour() -> None:
    keda, hpa_mode = rendered("autoscaling.mode=keda"), rendered()
    assert "HorizontalPodAutoscaler" not in keda and "ConfigMap" not in keda
    scaled = keda["ScaledObject"]["spec"]
    [trigger] = scaled["triggers"]
    assert trigger["metadata"]["query"] == 'max(controlplane_pool_nodes_wanted{pool="gpu-a"})'
    assert (trigger["metricType"], trigger["metadata"]["threshold"]) == ("AverageValue", "1")
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == hpa_mode["HorizontalPodAutoscaler"]["spec"]["behavior"]
    assert "replicas" in rendered("autoscaling.mode=none")["Deployment"]["spec"]


# The HPA on the product's series ------------------------------------------------------------------


def adapter_query(selector: dict[str, str]) -> str:
    """The adapter rule's metricsQuery, as prometheus-adapter fills it for the HPA's selector."""
    config = yaml.safe_load(rendered()["ConfigMap"]["data"]["config.yaml"])
    [rule] = config["externalRules"]
    series = rule["seriesQuery"].split("{")[0]
    assert rule["name"]["as"] == series
    matchers = ",".join(f'{name}="{value}"' for name, value in selector.items())
    return (
        rule["metricsQuery"].replace("<<.Series>>", series).replace("<<.LabelMatchers>>", matchers)
    )


def promtool_tests(tmp_path: Path, tests: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump({"evaluation_interval": "15s", **tests}))
    return run(tool("promtool"), "test", "rules", str(path))


@pytest.mark.django_db
def test_an_hpa_on_the_exported_series_asks_for_the_nodes_the_product_wants(
    tmp_path: Path, client: Client, viewer: User
) -> None:
    pool = NodePool.objects.create(name="gpu-a")
    for i in range(11):
        Node.objects.create(name=f"gpu-a-{i}", pool=pool, http_url="http://127.0.0.1:1")
    Scaling.objects.create(pool=pool, wanted=12, nodes=11, reasons=["load: ..."])
    Scaling.objects.create(pool=NodePool.objects.create(name="cpu"), wanted=3, nodes=3)
    exported = client.get("/metrics", headers=scrape_headers(viewer)).content.decode()
    lines = [
        line for line in exported.splitlines() if line.startswith("controlplane_pool_nodes_wanted")
    ]
    assert lines == [
        'controlplane_pool_nodes_wanted{pool="cpu"} 3.0',
        'controlplane_pool_nodes_wanted{pool="gpu-a"} 12.0',
    ]
    # Two web pods export the same series: the adapter's query must read one count, not two.
    series = [
        {"series": line.split(" ")[0].replace("{", f'{{instance="web-{web}",'), "values": "12x8"}
        for web in (1, 2)
        for line in lines[1:]
    ] + [{"series": lines[0].split(" ")[0], "values": "3x8"}]
    spec = rendered()["HorizontalPodAutoscaler"]["spec"]
    [metric] = spec["metrics"]
    assert (metric["type"], metric["external"]["metric"]["name"]) == (
        "External",
        "controlplane_pool_nodes_wanted",
    )
    selector = metric["external"]["metric"]["selector"]["matchLabels"]
    query = adapter_query(selector)
    result = promtool_tests(
        tmp_path,
        {
            "tests": [
                {
                    "interval": "15s",
                    "input_series": series,
                    "promql_expr_test": [
                        {
                            "expr": query,
                            "eval_time": "1m",
                            "exp_samples": [{"labels": '{pool="gpu-a"}', "value": 12}],
                        }
                    ],
                }
            ]
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    target = metric["external"]["target"]
    assert target["type"] == "AverageValue"
    tolerance = float(spec["behavior"]["scaleDown"]["tolerance"])
    assert tolerance == float(spec["behavior"]["scaleUp"]["tolerance"]) == 0
    for current in (1, 11, 13, 40):
        asked = hpa.external_average_value(
            current=current, value=12, target=float(target["averageValue"]), tolerance=tolerance
        )
        assert asked == 12
    # The controller's default tolerance would leave 11 nodes where 12 are wanted.
    assert hpa.external_average_value(current=11, value=12) == 11
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 20)


def test_promtool_checks_the_alert_and_it_fires_only_while_the_pool_is_short(
    tmp_path: Path,
) -> None:
    rules = rendered("alerts.enabled=true")["PrometheusRule"]["spec"]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    checked = run(tool("promtool"), "check", "rules", str(tmp_path / "rules.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr

    def case(wanted: int, ready: int) -> dict[str, Any]:
        return {
            "interval": "1m",
            "input_series": [
                {
                    "series": 'controlplane_pool_nodes_wanted{pool="gpu-a",instance="web-1"}',
                    "values": f"{wanted}x30",
                },
                *(
                    {
                        "series": f'controlplane_nodes{{pool="gpu-a",health="{health}",'
                        f'instance="web-{web}"}}',
                        "values": f"{count}x30",
                    }
                    for web in (1, 2)
                    for health, count in (("ready", ready), ("unreachable", 1))
                ),
            ],
            "alert_rule_test": [
                {
                    "alertname": "TritonPoolShortOfNodes",
                    "eval_time": "20m",
                    "exp_alerts": [
                        {
                            "exp_labels": {"pool": "gpu-a", "severity": "warning"},
                            "exp_annotations": {
                                "summary": f"Pool gpu-a wants {wanted} nodes and has fewer: see its scaling page"
                            },
                        }
                    ]
                    if wanted > ready + 1
                    else [],
                }
            ],
        }

    result = promtool_tests(
        tmp_path, {"rule_files": ["rules.yml"], "tests": [case(6, 4), case(5, 4), case(3, 4)]}
    )
    assert result.returncode == 0, result.stdout + result.stderr

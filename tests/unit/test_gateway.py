"""A pool's traffic as a Kubernetes Gateway API HTTPRoute: the renderer on its own (no database),
then the API endpoint that serves it."""

from typing import Any

import pytest
import yaml
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.fleet.models import Node, NodePool
from apps.fleet.traffic.gateway import GatewayError, httproute
from tests.support.users import bearer

YAML = "application/yaml; charset=utf-8"


def fleet() -> tuple[NodePool, list[Node]]:
    """Three nodes out of name order, with distinct weights, one of them drained for a load."""
    pool = NodePool(name="gpu", traffic=NodePool.Traffic.HAPROXY)
    nodes = [
        Node(name="gpu-c", pool=pool, weight=30),
        Node(name="gpu-a", pool=pool, weight=10),
        Node(name="gpu-b", pool=pool, weight=20, draining=True),
    ]
    return pool, nodes


def backends(route: dict[str, Any]) -> list[dict[str, Any]]:
    (rule,) = route["spec"]["rules"]
    return rule["backendRefs"]


def test_a_route_sends_each_nodes_service_its_wanted_weight_in_name_order() -> None:
    pool, nodes = fleet()
    route = yaml.safe_load(httproute(pool, nodes, gateway="edge", namespace="ml", port=8080))
    assert (route["apiVersion"], route["kind"]) == ("gateway.networking.k8s.io/v1", "HTTPRoute")
    assert route["metadata"] == {
        "name": "gpu-triton",
        "namespace": "ml",
        "labels": {
            "app.kubernetes.io/managed-by": "triton-control-plane",
            "triton-control-plane/pool": "gpu",
        },
    }
    assert route["spec"]["parentRefs"] == [{"name": "edge"}]
    assert route["spec"]["rules"][0]["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/v2"}}
    ]
    assert backends(route) == [
        {"name": "gpu-a", "port": 8080, "weight": 10},
        {"name": "gpu-b", "port": 8080, "weight": 0},  # drained while a worker loads on it
        {"name": "gpu-c", "port": 8080, "weight": 30},
    ]
    assert [b["weight"] for b in backends(route)] == [
        n.wanted_weight for n in sorted(nodes, key=lambda n: n.name)
    ]


def test_a_route_defaults_to_the_triton_gateway_in_the_default_namespace() -> None:
    pool, nodes = fleet()
    route = yaml.safe_load(httproute(pool, nodes))
    assert route["metadata"]["namespace"] == "default"
    assert route["spec"]["parentRefs"] == [{"name": "triton"}]
    assert {b["port"] for b in backends(route)} == {8000}


@pytest.mark.parametrize(
    ("pool_name", "node_name", "named"),
    [("gpu_east", "gpu-1", "pool 'gpu_east'"), ("gpu", "GPU-1", "node 'GPU-1'")],
)
def test_a_pool_or_node_name_kubernetes_refuses_is_named_not_rendered(
    pool_name: str, node_name: str, named: str
) -> None:
    pool = NodePool(name=pool_name)
    with pytest.raises(GatewayError, match=named):
        httproute(pool, [Node(name=node_name, pool=pool)])


def make_pool(name: str, nodes: int) -> NodePool:
    pool = NodePool.objects.create(name=name, traffic=NodePool.Traffic.HAPROXY)
    Node.objects.bulk_create(
        Node(
            name=f"{name}-{n:02}",
            pool=pool,
            http_url=f"http://10.0.0.{n}:8000",
            weight=10 * (n + 1),
        )
        for n in range(nodes)
    )
    return pool


@pytest.mark.django_db
def test_the_api_serves_a_pools_route_as_yaml_to_any_role(client: Client, viewer: User) -> None:
    make_pool("gpu", 3)
    Node.objects.filter(name="gpu-01").update(draining=True)
    headers = bearer(viewer)
    query = {"gateway": "edge.infra", "namespace": "ml", "port": 8080}
    response = client.get("/api/pools/gpu/httproute", query, headers=headers)
    assert response.status_code == 200 and response["Content-Type"] == YAML
    route = yaml.safe_load(response.content)
    assert route["metadata"]["name"] == "gpu-triton" and route["metadata"]["namespace"] == "ml"
    assert route["spec"]["parentRefs"] == [{"name": "edge.infra"}]
    assert backends(route) == [
        {"name": "gpu-00", "port": 8080, "weight": 10},
        {"name": "gpu-01", "port": 8080, "weight": 0},
        {"name": "gpu-02", "port": 8080, "weight": 30},
    ]
    assert client.get("/api/pools/gpu/httproute").status_code == 401


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ({"gateway": "Edge_GW"}, "query.gateway", "not a Kubernetes name (RFC 1123 subdomain"),
        ({"gateway": "a" * 254}, "query.gateway", "at most 253 characters"),
        ({"namespace": "ml.prod"}, "query.namespace", "not a Kubernetes name (RFC 1123 label"),
        ({"namespace": "-ml"}, "query.namespace", "not a Kubernetes name"),
        ({"port": 0}, "query.port", "greater than or equal to 1"),
        ({"port": 65536}, "query.port", "less than or equal to 65535"),
    ],
)
def test_a_bad_gateway_namespace_or_port_is_refused_naming_the_field(
    client: Client, viewer: User, query: dict[str, object], field: str, says: str
) -> None:
    make_pool("gpu", 1)
    response = client.get("/api/pools/gpu/httproute", query, headers=bearer(viewer))
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["message"].startswith(f"{field}: ") and says in error["message"]
    assert [d["loc"] for d in error["details"]] == [field.split(".")]


@pytest.mark.django_db
def test_an_unknown_pool_is_the_apis_usual_404(client: Client, viewer: User) -> None:
    response = client.get("/api/pools/nope/httproute", headers=bearer(viewer))
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.django_db
def test_a_node_kubernetes_cannot_name_makes_the_route_a_409_that_names_it(
    client: Client, viewer: User
) -> None:
    pool = make_pool("gpu", 1)
    Node.objects.create(name="GPU_2", pool=pool, http_url="http://10.0.0.9:8000")
    response = client.get("/api/pools/gpu/httproute", headers=bearer(viewer))
    assert response.status_code == 409
    assert "node 'GPU_2'" in response.json()["error"]["message"]


@pytest.mark.django_db
def test_a_route_costs_the_same_queries_for_3_nodes_as_for_30(client: Client, viewer: User) -> None:
    headers = bearer(viewer)

    def queries(pool: str) -> tuple[int, int, int]:
        with CaptureQueriesContext(connection) as captured:
            response = client.get(f"/api/pools/{pool}/httproute", headers=headers)
        assert response.status_code == 200
        fleet_queries = [q for q in captured if "fleet_node" in q["sql"]]
        return len(captured), len(fleet_queries), len(backends(yaml.safe_load(response.content)))

    make_pool("few", 3)
    make_pool("many", 30)
    few, few_fleet, few_nodes = queries("few")
    many, many_fleet, many_nodes = queries("many")
    assert (few_nodes, many_nodes) == (3, 30)
    assert many == few
    assert few_fleet == many_fleet == 2  # the pool, then its nodes

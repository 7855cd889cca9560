"""A pool's traffic as a Kubernetes Gateway API `HTTPRoute` (gateway.networking.k8s.io/v1): the
same per-node weights HAProxy gets (`Node.wanted_weight`: a rollout's shares, 0 while a worker
drains the node), for clusters whose gateway splits the traffic instead.

Convention: one Service per Triton node, named as the node (say, a headless Service per pod, or
the per-pod Services of a StatefulSet), in the route's namespace; the route sends each a share
of the pool's `/v2` requests (Triton's HTTP/REST API)."""

import re

import yaml

from apps.fleet.models import Node, NodePool

# Kubernetes' own rules: a namespace (and a label value) is an RFC 1123 label, a Gateway's name
# an RFC 1123 subdomain, a Service's name an RFC 1035 label (it starts with a letter).
LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
SUBDOMAIN = rf"{LABEL}(\.{LABEL})*"
DNS_LABEL = re.compile(LABEL)
DNS_SUBDOMAIN = re.compile(rf"(?=.{{1,253}}$){SUBDOMAIN}")
SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
MANAGED_BY = "triton-control-plane"


class GatewayError(Exception):
    """The pool or a node has a name Kubernetes does not accept; the message says which."""


def httproute(
    pool: NodePool,
    nodes: list[Node],
    *,
    gateway: str = "triton",
    namespace: str = "default",
    port: int = 8000,
) -> str:
    """The pool's HTTPRoute, as YAML: each node's Service at its weight, nodes in name order."""
    if not DNS_LABEL.fullmatch(pool.name):
        raise GatewayError(f"pool {pool.name!r}: not a Kubernetes name (RFC 1123 label)")
    for node in nodes:
        if not SERVICE_NAME.fullmatch(node.name):
            raise GatewayError(f"node {node.name!r}: not a Kubernetes Service name (RFC 1035)")
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {
            "name": f"{pool.name}-triton",
            "namespace": namespace,
            "labels": {
                "app.kubernetes.io/managed-by": MANAGED_BY,
                "triton-control-plane/pool": pool.name,
            },
        },
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
                    "backendRefs": [
                        {"name": node.name, "port": port, "weight": node.wanted_weight}
                        for node in sorted(nodes, key=lambda n: n.name)
                    ],
                }
            ],
        },
    }
    return yaml.safe_dump(route, sort_keys=False)

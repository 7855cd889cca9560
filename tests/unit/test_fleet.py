import json
import re
from contextvars import copy_context
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.context import REQUEST_ID
from apps.audit.models import AuditEvent
from apps.fleet import tasks
from apps.fleet.desired import fleet_desired, node_desired
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.node_metrics import parse_gpu_memory
from apps.fleet.reconcile import node_reconcile
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register, operation_request
from apps.fleet.tasks import enqueue_run
from apps.fleet.triton import IndexEntry, TritonClient
from apps.registry.models import ModelVersion
from apps.registry.services import version_set_status
from tests.support.users import make_user

pytestmark = pytest.mark.django_db
URLS = {"grpc_url": "127.0.0.1:8101", "metrics_url": "http://127.0.0.1:8102/metrics"}


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://10.0.0.1:8000", "use http:// or https://"),
        ("http://admin:secret@10.0.0.1:8000", "no credentials"),
        ("http://10.0.0.1:99999", "port is not a number"),
        ("http://:8000", "a host is required"),
    ],
)
def test_node_addresses_are_validated(url: str, message: str) -> None:
    with pytest.raises(FleetError, match=message):
        node_register(name="n1", pool="p", http_url=url, actor="system:test", **URLS)
    assert not Node.objects.exists()


def test_gpu_memory_is_read_per_gpu_from_tritons_metrics() -> None:
    text = (
        "# HELP nv_gpu_memory_total_bytes GPU total memory, in bytes\n"
        'nv_gpu_memory_total_bytes{gpu_uuid="GPU-a1"} 85899345920\n'
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-a1"} 1073741824\n'
        'nv_gpu_memory_total_bytes{gpu_uuid="GPU-b2"} 85899345920\n'
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-b2"} 0\n'
        "nv_cpu_memory_used_bytes 663834624\n"
    )
    assert parse_gpu_memory(text) == [
        {"uuid": "GPU-a1", "total": 85899345920.0, "used": 1073741824.0},
        {"uuid": "GPU-b2", "total": 85899345920.0, "used": 0.0},
    ]
    assert parse_gpu_memory("nv_cpu_memory_used_bytes 1\n") == []


def test_an_ensemble_deployment_desires_its_pinned_steps(
    node: Node, django_capture_on_commit_callbacks: object
) -> None:
    deployment_set(model_name="rag_pipeline", version=3, pool=node.pool, actor="system:test")
    desired = node_desired(node)
    assert {name: d.versions for name, d in desired.items()} == {
        "rag_pipeline": (3,),
        "embedder": (2,),
        "retriever": (2,),
        "reranker": (3,),
        "generator": (2,),
    }
    # protobuf JSON writes int64 as strings, which Triton reads
    assert desired["reranker"].config["version_policy"] == {"specific": {"versions": ["3"]}}


def test_a_node_deployment_overrides_the_pools(node: Node) -> None:
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    deployment_set(model_name="embedder", version=2, node=node, actor="system:test")
    assert node_desired(node)["embedder"].versions == (2,)


@pytest.fixture
def computed(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """One entry each time a desired state is computed, not read back from its cache."""
    from apps.fleet import desired

    calls: list[dict] = []
    original = desired.fleet_desired
    monkeypatch.setattr(desired, "fleet_desired", lambda **kw: calls.append(kw) or original(**kw))
    return calls


def test_a_pools_nodes_share_one_desired_state_computed_again_on_every_change(
    node: Node, computed: list[dict]
) -> None:
    from apps.fleet import desired

    other = node_register(
        name="n2", pool="p", http_url="http://127.0.0.1:2", actor="system:test", **URLS
    )
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    assert node_desired(node) is node_desired(other)
    assert len(computed) == 1
    # A rollback to the earlier version is a change too, not the first state seen again.
    for version in (2, 1):
        deployment_set(model_name="embedder", version=version, pool=node.pool, actor="system:test")
        assert node_desired(other)["embedder"].versions == (version,)
    assert len(computed) == 3
    # A step pinned to the latest follows the registry: every release or deprecation counts.
    before = desired.desired_inputs(node)
    published = ModelVersion.objects.filter(status=ModelVersion.Status.PUBLISHED).first()
    assert published is not None
    version_set_status(version_id=published.pk, status="deprecated", actor="system:test")
    assert desired.desired_inputs(node) != before


def test_a_change_made_while_a_desired_state_is_computed_is_never_kept_as_the_one_before(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inputs are read, a canary's node deployment commits, the state is computed with it;
    once the canary is dropped the inputs read as before, and must not find the canary's."""
    from apps.fleet import desired

    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    original = desired.fleet_desired

    def racing(**kwargs: object) -> object:
        monkeypatch.setattr(desired, "fleet_desired", original)  # once
        deployment_set(model_name="embedder", version=2, node=node, actor="system:test")
        return original(**kwargs)

    monkeypatch.setattr(desired, "fleet_desired", racing)
    assert node_desired(node)["embedder"].versions == (2,)  # what it read: the canary
    Deployment.objects.filter(node=node).delete()  # the canary dropped: inputs as at first
    assert node_desired(node)["embedder"].versions == (1,)


def test_a_fleet_desired_state_is_built_again_only_after_a_change(node: Node) -> None:
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    first = fleet_desired(pool_ids=[node.pool_id])
    assert fleet_desired(pool_ids=[node.pool_id]) is first  # a page shown again
    deployment_set(model_name="embedder", version=2, node=node, actor="system:test")
    canary = fleet_desired(pool_ids=[node.pool_id])
    assert canary is not first and canary.of(node)["embedder"].versions == (2,)
    Deployment.objects.filter(node=node).delete()  # inputs as at first: its state again
    assert fleet_desired(pool_ids=[node.pool_id]).of(node)["embedder"].versions == (1,)


def test_a_double_click_deploys_once(
    node: Node, django_capture_on_commit_callbacks: object
) -> None:
    for _ in range(2):
        deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    assert Deployment.objects.count() == 1
    assert AuditEvent.objects.filter(action="deployment.set").count() == 1


def test_unloading_a_deployed_model_is_refused_with_what_to_do(node: Node) -> None:
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    with pytest.raises(FleetError, match="change or remove the deployment instead"):
        operation_request(
            node_id=node.pk, kind="unload", model_name="embedder", actor="system:test"
        )
    assert not Operation.objects.exists()


def test_a_second_reload_click_returns_the_open_operation(node: Node) -> None:
    deployment_set(model_name="embedder", version=1, node=node, actor="system:test")
    first = operation_request(
        node_id=node.pk, kind="reload", model_name="embedder", actor="system:test"
    )
    second = operation_request(
        node_id=node.pk, kind="reload", model_name="embedder", actor="system:test"
    )
    assert first == second and Operation.objects.count() == 1


def test_node_page_polling_stops_when_nothing_is_open(
    client: Client, viewer: User, node: Node
) -> None:
    client.force_login(viewer)
    live = {"HX-Request": "true", "HX-Target": "node-live"}
    assert client.get("/nodes/n1/", headers=live).status_code == 286
    Operation.objects.create(node=node, kind="load", model_name="embedder", requested_by="t")
    response = client.get("/nodes/n1/", headers=live)
    assert response.status_code == 200 and "queued" in response.content.decode()


def test_an_unmanaged_model_is_shown_as_such(client: Client, viewer: User, node: Node) -> None:
    Node.objects.filter(pk=node.pk).update(
        index=[{"model": "mystery", "version": 1, "state": "READY", "reason": ""}]
    )
    client.force_login(viewer)
    body = client.get("/nodes/n1/").content.decode()
    assert "mystery" in body and "unmanaged" in body


def test_a_viewer_cannot_deploy(client: Client, viewer: User, node: Node) -> None:
    client.force_login(viewer)
    response = client.post("/deployments/p/", {"model_version": "embedder:1"})
    assert response.status_code == 403 and not Deployment.objects.exists()
    assert AuditEvent.objects.filter(action="deployment.set", result="denied").exists()


def test_a_release_manager_deploys_to_a_pool_from_the_page_and_an_operator_may_not(
    client: Client, operator: User, node: Node
) -> None:
    client.force_login(operator)
    refused = client.post("/deployments/p/", {"model_version": "rag_pipeline:2"})
    assert refused.status_code == 403 and not Deployment.objects.exists()
    client.force_login(make_user(Role.RELEASE_MANAGER))
    response = client.post("/deployments/p/", {"model_version": "rag_pipeline:2"})
    assert response.status_code == 302
    assert Deployment.objects.get().version == 2
    assert "rag_pipeline v2" in client.get("/deployments/").content.decode()
    assert NodePool.objects.get(name="p").deployments.count() == 1


def test_a_refused_deployment_answers_htmx_with_its_message_and_status(
    client: Client, node: Node
) -> None:
    """htmx swaps nothing on an error by itself: static/app.js says the message where the form
    is, so the refusal must come back as an error with the reason in it."""
    client.force_login(make_user(Role.RELEASE_MANAGER))
    htmx = {"HX-Request": "true"}
    response = client.post("/deployments/p/", {"model_version": "rag_pipeline:99"}, headers=htmx)
    assert response.status_code == 409
    assert response.content.decode().startswith('<p class="flash error">pool p: ')
    assert "rag_pipeline v99" in response.content.decode() and not Deployment.objects.exists()
    plain = client.post("/deployments/p/", {"model_version": "rag_pipeline:99"}, follow=True)
    assert "pool p: " in plain.content.decode()  # a plain form: on the page it goes back to


def test_one_worker_at_a_time_holds_a_node_and_a_lapsed_lease_frees_it(node: Node) -> None:
    from apps.fleet.lease import Lease

    with Lease(node.pk).hold() as first:
        assert first.held
        with Lease(node.pk).hold() as second:
            assert not second.held
    with Lease(node.pk).hold() as again:
        assert again.held  # released on exit
    # A worker killed with SIGKILL stops renewing: once the lease lapses, another worker takes it.
    Node.objects.filter(pk=node.pk).update(
        lease_owner="dead", lease_until=timezone.now() - timedelta(seconds=1)
    )
    with Lease(node.pk).hold() as taken:
        assert taken.held


def test_a_run_asked_for_a_node_since_removed_ends_instead_of_waiting_its_turn(
    node: Node,
) -> None:
    from apps.fleet.lease import Lease
    from apps.fleet.runner import NodeBusy, node_run

    with Lease(node.pk).hold(), pytest.raises(NodeBusy):  # another worker's: tried again later
        node_run(node_id=node.pk)
    gone = node.pk
    node.delete()
    node_run(node_id=gone)  # nothing to hold, nothing left to run: no retries


def test_a_stale_plan_is_cancelled_not_executed(node: Node) -> None:
    from apps.fleet.runner import node_run

    deployment_set(model_name="embedder", version=1, node=node, actor="system:test")
    stale = Operation.objects.create(
        node=node,
        kind="load",
        model_name="embedder",
        versions=[1],
        plan_digest="an-older-plan",
        requested_by="system:reconciler",
    )
    node_run(node_id=node.pk)  # the node is unreachable: executing would fail, cancelling must not
    stale.refresh_from_db()
    assert stale.status == "cancelled" and "superseded" in stale.error and stale.attempts == 0


def test_an_operation_left_running_by_a_dead_worker_becomes_unknown(node: Node) -> None:
    from apps.fleet.runner import node_run

    orphan = Operation.objects.create(
        node=node,
        kind="load",
        model_name="embedder",
        versions=[1],
        status="running",
        requested_by="t",
    )
    node_run(node_id=node.pk)
    orphan.refresh_from_db()
    assert orphan.status == "unknown" and "worker was lost" in orphan.error


def test_work_whose_run_was_lost_is_run_by_the_next_reconcile_and_young_work_is_not(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    sent: list[str] = []
    monkeypatch.setattr(TritonClient, "load", lambda self, model, **_: sent.append(model))
    deployment_set(model_name="embedder", version=1, node=node, actor="ops")
    person = operation_request(node_id=node.pk, model_name="embedder", kind="reload", actor="ops")
    tasks.reconcile_nodes([node.pk])  # just queued: its own run is about to take it
    assert sent == [] and Operation.objects.get().status == "queued"
    long_ago = timezone.now() - timedelta(seconds=settings.FLEET_LEASE_S + 1)
    Operation.objects.filter(pk=person.pk).update(created_at=long_ago)  # its run never came
    tasks.reconcile_nodes([node.pk])
    assert sent == ["embedder"]


def test_a_refused_step_cancels_the_rest_of_its_plan_but_not_a_persons_operation(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.fleet.runner import node_run
    from apps.fleet.triton import TritonClient, TritonRejected

    def refuse(self: TritonClient, model: str, *, config_json: str | None = None) -> None:
        raise TritonRejected(self.node, f"load failed for model '{model}'")

    monkeypatch.setattr(TritonClient, "load", refuse)  # the boundary: Triton says no
    deployment_set(model_name="rag_pipeline", version=1, node=node, actor="system:test")
    digest = node_desired(node).plan_digest
    plan = [
        Operation.objects.create(
            node=node,
            kind="load",
            model_name=name,
            versions=[1],
            plan_digest=digest,
            seq=seq,
            requested_by="system:reconciler",
        )
        for seq, name in enumerate(["embedder", "rag_pipeline"])
    ]
    person = Operation.objects.create(
        node=node, kind="unload", model_name="mystery", seq=5, requested_by="ops"
    )
    monkeypatch.setattr(TritonClient, "unload", lambda *args, **kwargs: None)
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    node_run(node_id=node.pk)
    first, second = (Operation.objects.get(pk=op.pk) for op in plan)
    assert first.status == "failed" and "load failed for model 'embedder'" in first.error
    assert second.status == "cancelled" and "step 0 (load embedder) failed" in second.error
    assert Operation.objects.get(pk=person.pk).status == "succeeded"


def _ready(*models: str) -> list[dict]:
    return [{"model": m, "version": "1", "state": "READY", "reason": ""} for m in models]


def test_the_nodes_page_filters_searches_and_pages_on_the_server(
    client: Client, viewer: User
) -> None:
    gpu, cpu = NodePool.objects.create(name="gpu"), NodePool.objects.create(name="cpu")
    for i in range(60):
        Node.objects.create(
            name=f"gpu-{i:02d}",
            pool=gpu,
            http_url=f"http://10.0.0.{i}:8000",
            health="unreachable" if i % 25 == 4 else "ready",
            index=_ready("embedder") if i % 2 else [],
        )
    Node.objects.create(name="cpu-01", pool=cpu, http_url="http://10.9.0.1:8000", index=[])
    client.force_login(viewer)

    def names(query: str) -> list[str]:
        body = client.get(f"/nodes/?{query}").content.decode()
        return re.findall(r'<tr id="node-([\w-]+)"', body)

    first = names("")
    assert len(first) == 50 and first[0] == "cpu-01"
    assert names("page=2") == [f"gpu-{i:02d}" for i in range(49, 60)]
    assert names("pool=cpu") == ["cpu-01"]
    assert names("health=unreachable") == ["gpu-04", "gpu-29", "gpu-54"]
    assert names("q=10.0.0.7:") == ["gpu-07"]
    assert names("model=embedder&pool=gpu&health=unreachable") == ["gpu-29"]
    # The embedder is on odd nodes but no deployment names it: unmanaged, so they show drift.
    assert names("drift=1&health=unreachable") == ["gpu-29"]
    body = client.get("/nodes/?pool=gpu&page=2", headers={"HX-Request": "true"}).content.decode()
    assert "60 nodes match: 57 ready, 3 unreachable, 30 drifting." in body
    assert 'hx-get="/nodes/?pool=gpu&amp;page=2"' in body
    assert body.count('<tr id="node-') == 10


def test_nodes_alike_are_counted_together_and_a_canary_node_apart(
    client: Client, viewer: User, node: Node
) -> None:
    """The pages count shapes of nodes, not nodes: a node with a deployment of its own (a
    canary) is judged on its own desired state, though its index is its neighbours'."""
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    for name in ("n2", "n3"):
        Node.objects.create(name=name, pool=node.pool, http_url=f"http://{name}:8000")
    v1 = [{"model": "embedder", "version": "1", "state": "READY", "reason": ""}]
    Node.objects.update(index=v1, health="ready")
    canary = Node.objects.get(name="n3")
    deployment_set(model_name="embedder", version=2, node=canary, actor="system:test")
    client.force_login(viewer)
    body = client.get("/nodes/").content.decode()
    assert "3 nodes: 3 ready, 0 unreachable, 1 drifting." in body
    drifting = client.get("/nodes/?drift=1").content.decode()
    assert re.findall(r'<tr id="node-([\w-]+)"', drifting) == ["n3"]
    assert "embedder: READY [1], desired [2]" in drifting
    glance = client.get("/deployments/").content.decode()
    assert '<a href="/nodes/n3/">n3</a>' in glance and '<a href="/nodes/n2/">' not in glance


def test_a_node_whose_target_is_gone_drifts_apart_from_its_listed_neighbours(
    client: Client, viewer: User, node: Node
) -> None:
    """Alike but for discovery's listing: the balancer must give the unlisted node no weight,
    and shows 100, while its neighbours get what they should."""
    NodePool.objects.filter(pk=node.pool_id).update(traffic=NodePool.Traffic.HAPROXY)
    for name in ("n2", "n3"):
        Node.objects.create(name=name, pool=node.pool, http_url=f"http://{name}:8000")
    Node.objects.update(health="ready", served_weight=100)
    Node.objects.filter(name="n2").update(unlisted_since=timezone.now())
    client.force_login(viewer)
    assert "3 nodes: 3 ready, 0 unreachable, 1 drifting." in client.get("/nodes/").content.decode()
    drifting = client.get("/nodes/?drift=1").content.decode()
    assert re.findall(r'<tr id="node-([\w-]+)"', drifting) == ["n2"]
    assert "weight 0, the balancer shows 100" in drifting


def test_the_deployments_page_names_the_first_few_drifting_nodes_of_each_pool(
    client: Client, viewer: User
) -> None:
    stray = [{"model": "stray", "version": "1", "state": "READY", "reason": ""}]
    for pool in NodePool.objects.bulk_create(NodePool(name=p) for p in ("a", "b")):
        Node.objects.bulk_create(
            Node(name=f"{pool.name}{i}", pool=pool, http_url="http://10.0.0.1:8000", index=stray)
            for i in range(8)
        )
    Node.objects.filter(name__in=["a0", "b7"]).update(health="ready")  # shapes of their own
    client.force_login(viewer)
    views = client.get("/deployments/").context["pools"]
    names = {view.pool.name: [row.node.name for row in view.drifting] for view in views}
    assert names == {"a": ["a0", "a1", "a2", "a3", "a4"], "b": ["b0", "b1", "b2", "b3", "b4"]}
    assert [view.summary.drifted for view in views] == [8, 8]


def test_an_unmanaged_model_can_be_adopted_and_only_then_unloaded(
    client: Client, operator: User, node: Node
) -> None:
    Node.objects.filter(pk=node.pk).update(index=_ready("mystery"))
    client.force_login(operator)
    operate = lambda kind: client.post(  # noqa: E731
        f"/nodes/{node.name}/operate/", {"kind": kind, "model": "mystery"}, follow=True
    ).content.decode()
    assert "adopt it first" in operate("unload")
    assert not Operation.objects.exists()
    assert "mystery on n1 is managed now" in operate("adopt")
    assert Node.objects.get(pk=node.pk).owned == ["mystery"]
    assert "Unload of mystery on n1 queued." in operate("unload")
    event = AuditEvent.objects.get(action="node.adopt")
    assert (event.actor, event.target) == (operator.username, "node:n1:mystery")


def names(argument: int | list[int]) -> str:
    """The nodes a task was sent for: one node's id, or a chunk's."""
    ids = argument if isinstance(argument, list) else [argument]
    return ",".join(Node.objects.filter(pk__in=ids).order_by("name").values_list("name", flat=True))


def test_node_work_goes_to_each_pools_own_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    NodePool.objects.create(name="eu", queue="eu-west")
    NodePool.objects.create(name="us")
    for name, pool in (("eu-1", "eu"), ("eu-2", "eu"), ("us-1", "us")):
        Node.objects.create(name=name, pool=NodePool.objects.get(name=pool), http_url="http://x:1")
    sent: list[tuple[str, str | None]] = []
    for task in (tasks.poll_node, tasks.reconcile_nodes, tasks.run_node):
        monkeypatch.setattr(
            task,
            "apply_async",
            lambda args, queue=None, task=task: sent.append((task.name, names(args[0]), queue)),
        )
    tasks.poll_nodes()
    tasks.reconcile_all()
    enqueue_run(Node.objects.get(name="us-1").pk)
    assert sorted(sent) == [
        ("fleet.poll_node", "eu-1", "eu-west"),
        ("fleet.poll_node", "eu-2", "eu-west"),
        ("fleet.poll_node", "us-1", None),
        ("fleet.reconcile_nodes", "eu-1", "eu-west"),
        ("fleet.reconcile_nodes", "eu-2", "eu-west"),
        ("fleet.reconcile_nodes", "us-1", None),
        ("fleet.run_node", "us-1", None),
    ]


def test_a_periodic_reconcile_records_the_change_under_the_request_that_made_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # an empty node
    token = REQUEST_ID.set("req-deploy")
    try:
        deployment_set(model_name="embedder", version=1, pool=node.pool, actor="ops")
    finally:
        REQUEST_ID.reset(token)

    def reconcile() -> str:
        """A reconcile from beat: no request of its own."""

        def run() -> str:
            node_reconcile(node_id=node.pk)
            return REQUEST_ID.get()

        return copy_context().run(run)

    assert reconcile() == "req-deploy"
    drift = AuditEvent.objects.get(action="node.drift")
    assert drift.request_id == "req-deploy"
    # The same desired state repaired again (the load failed, say) is nobody's request.
    Operation.objects.update(status=Operation.Status.FAILED, config_digest="other")
    assert reconcile() == ""


def test_each_node_of_a_periodic_chunk_is_recorded_under_its_own_request(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk's nodes share a task, not a request: the request one node's plan adopts ends
    with that node."""
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # empty nodes
    monkeypatch.setattr(tasks, "node_run", lambda **_: None)  # planned is enough here
    other = node_register(
        name="n2", pool="q", http_url="http://127.0.0.1:1", grpc_url="", metrics_url="", actor="ops"
    )
    for request, pool in (("req-p", node.pool), ("req-q", other.pool)):
        token = REQUEST_ID.set(request)
        try:
            deployment_set(model_name="embedder", version=1, pool=pool, actor="ops")
        finally:
            REQUEST_ID.reset(token)
    copy_context().run(tasks.reconcile_nodes, [node.pk, other.pk])  # from beat: no request
    drifts = AuditEvent.objects.filter(action="node.drift")
    assert dict(drifts.values_list("target", "request_id")) == {
        "node:n1": "req-p",
        "node:n2": "req-q",
    }


def test_a_reconcile_hands_its_desired_state_to_the_run_and_a_change_still_stops_it(
    node: Node, computed: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run used to compute the desired state again, its dearest step at 500 nodes."""
    from apps.fleet import runner

    loaded: list[tuple[str, int]] = []
    monkeypatch.setattr(  # what was loaded reads back READY
        TritonClient,
        "repository_index",
        lambda self: [IndexEntry(m, v, "READY", "") for m, v in loaded],
    )
    changed = []

    def load(self: TritonClient, model: str, *, config_json: str | None = None) -> None:
        policy = json.loads(config_json or "{}")["version_policy"]["specific"]["versions"]
        loaded.extend((model, int(v)) for v in policy)
        if not changed:  # during the first step, someone deploys another version
            changed.append(model)
            deployment_set(model_name="rag_pipeline", version=2, node=node, actor="ops")

    monkeypatch.setattr(TritonClient, "load", load)
    deployment_set(model_name="rag_pipeline", version=1, node=node, actor="ops")
    tasks.reconcile_nodes([node.pk])
    assert len(computed) == 1  # once, for the plan; the run started from it
    monkeypatch.setattr(runner.DesiredDigest, "RECHECK_S", 0.0)  # every step looks again
    Operation.objects.all().delete()
    computed.clear()
    changed.clear()
    loaded.clear()
    deployment_set(model_name="rag_pipeline", version=1, node=node, actor="ops")
    tasks.reconcile_nodes([node.pk])
    statuses = list(Operation.objects.order_by("seq").values_list("status", flat=True))
    assert statuses[0] == "succeeded" and set(statuses[1:]) == {"cancelled"}
    assert len(computed) == 2  # the plan's, and the run's once the deployments changed


def test_an_index_read_while_a_run_ended_is_read_again_before_anything_is_planned(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race CI met: a reconcile read the node's index while another worker's run loaded the
    pipeline; the run ended before the reconcile locked the node, and the load was sent twice."""
    from apps.fleet.reconcile import nodes_reconcile

    deployment_set(model_name="embedder", version=1, node=node, actor="ops")
    digest = node_desired(node)["embedder"].digest
    served: list[IndexEntry] = []

    def read(self: TritonClient) -> list[IndexEntry]:
        listed = list(served)  # what Triton listed when the read went out
        if not served:  # meanwhile another worker's load ends, read back READY
            Operation.objects.create(
                node=node,
                kind="load",
                model_name="embedder",
                versions=[1],
                config_digest=digest,
                status="succeeded",
                finished_at=timezone.now(),
                requested_by="system:reconciler",
            )
            served.append(IndexEntry("embedder", 1, "READY", ""))
        return listed

    monkeypatch.setattr(TritonClient, "repository_index", read)
    assert nodes_reconcile([node.pk]) == {}  # its index predates that end
    assert nodes_reconcile([node.pk]) == {}  # read again: it serves what it should
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    planned = nodes_reconcile([node.pk])  # Triton lost it since: repaired
    assert [str(op) for op in planned[node.pk].ops] == ["load embedder [1] on n1"]


def test_a_chunks_plans_are_written_as_planned_each_with_its_own_id(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plans of a chunk are written in one statement on PostgreSQL (apps.web.bulk): each
    operation must come back with its own id, every field as the run will read it."""
    from apps.fleet.reconcile import nodes_reconcile

    other = node_register(
        name="n2", pool="p", http_url="http://127.0.0.1:2", actor="system:test", **URLS
    )
    deployment_set(model_name="rag_pipeline", version=1, pool=node.pool, actor="system:test")
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])  # serving nothing
    planned = nodes_reconcile([node.pk, other.pk])
    ops = [op for plan in planned.values() for op in plan.ops]
    assert len(ops) == 10 and len({op.pk for op in ops}) == 10
    fields = [f.attname for f in Operation._meta.concrete_fields]
    stored = {row["id"]: row for row in Operation.objects.values(*fields)}
    assert [{name: getattr(op, name) for name in fields} for op in ops] == [
        stored[op.pk] for op in ops
    ]
    assert [(op.node_id, op.seq) for op in ops] == [
        (n.pk, s) for n in (node, other) for s in range(5)
    ]
    # Their drift events go the same way (audit_append), each with its target's parts.
    drifts = AuditEvent.objects.filter(action="node.drift").order_by("id")
    assert [
        (e.target, e.target_type, e.target_name, len(e.after["operations"])) for e in drifts
    ] == [
        ("node:n1", "node", "n1", 5),
        ("node:n2", "node", "n2", 5),
    ]


def test_the_overview_lists_failures_not_since_repaired_newest_first(
    node: Node, admin_user: User, client: Client
) -> None:
    now = timezone.now()

    def ended(model: str, status: str, minutes: int, error: str = "") -> Operation:
        return Operation.objects.create(
            node=node,
            kind="load",
            model_name=model,
            status=status,
            error=error,
            finished_at=now - timedelta(minutes=minutes),
            requested_by="t",
        )

    ended("embedder", "failed", 9, "out of memory")
    ended("embedder", "succeeded", 8)  # repaired since
    ended("reranker", "failed", 7, "reranker: bad config")
    unknown = ended("generator", "unknown", 6, "no answer in time")
    repeated = ended("reranker", "failed", 5, "reranker: bad config again")
    client.force_login(admin_user)
    failing = client.get("/").context["failing"]
    assert [op.pk for op in failing] == [repeated.pk, unknown.pk]
    assert [op.node.name for op in failing] == ["n1", "n1"]


def test_the_deploy_form_offers_every_published_version_and_no_other(
    node: Node, admin_user: User, client: Client
) -> None:
    versions = ModelVersion.objects.select_related("model").order_by("model__name", "version")
    versions.filter(model__name="reranker", version=2).update(status=ModelVersion.Status.DRAFT)
    published = versions.filter(status=ModelVersion.Status.PUBLISHED)
    assert versions.exclude(status=ModelVersion.Status.PUBLISHED).exists()
    client.force_login(admin_user)
    html = client.get("/deployments/").content.decode()
    options = re.findall(r'<option value="([^"]+)">([^<]+)</option>', html)
    assert options == [(f"{v.model.name}:{v.version}", str(v)) for v in published]


def test_the_overview_shows_what_each_pool_runs(
    node: Node, admin_user: User, client: Client
) -> None:
    deployment_set(model_name="embedder", version=1, pool=node.pool, actor="system:test")
    deployment_set(model_name="reranker", version=2, pool=node.pool, actor="system:test")
    NodePool.objects.create(name="empty")
    client.force_login(admin_user)
    html = client.get("/").content.decode()
    rows = dict(re.findall(r'<tr id="pool-([^"]+)">(.*?)</tr>', html, re.S))
    chips = re.findall(r'<span class="chip">([^<]+)</span>', rows["p"])
    assert chips == ["embedder v1", "reranker v2"]
    assert '<span class="muted">nothing</span>' in rows["empty"]

"""Memory-aware loads: footprints (measured over declared), the room a node has, the refusal's
words, break before make in the planner, and a measurement, with Triton's metrics stubbed at
their module boundary."""

from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.fleet import memory, polling
from apps.fleet.errors import FleetError
from apps.fleet.models import Footprint, Node, NodePool
from apps.fleet.planner import plan
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_set_memory
from apps.fleet.triton import ServerMetadata, TritonClient
from apps.registry.models import Model, ModelVersion
from tests.support.planning import MANAGED, desired, kinds, ready

pytestmark = pytest.mark.django_db
GIB = 2**30


@pytest.fixture
def node() -> Node:
    model = Model.objects.create(name="step")
    for number in (1, 2, 3):
        ModelVersion.objects.create(model=model, version=number, config={"name": "step"})
    Footprint.objects.create(model_name="step", version=1, device="cpu", mb=300, samples=2)
    ModelVersion.objects.filter(version__in=[1, 2]).update(memory_mb=400)  # 1 is measured
    pool = NodePool.objects.create(name="cpu")
    return Node.objects.create(name="cpu-1", pool=pool, http_url="http://cpu-1:8000")


def test_a_measured_footprint_wins_over_the_declared_estimate(node: Node) -> None:
    found = memory.sizes({("step", 1), ("step", 2), ("step", 3)}, "cpu")
    assert found == {("step", 1): (300.0, "measured, 2 loads"), ("step", 2): (400.0, "declared")}
    assert memory.sizes({("step", 1)}, "gpu") == {("step", 1): (400.0, "declared")}


def test_a_nodes_room_is_its_limit_less_what_it_serves(node: Node) -> None:
    assert not memory.aware(node)
    assert memory.room(node, {"step": {1}}).free_mb is None  # no limit: anything fits
    node_set_memory(node_name="cpu-1", limit_mb=1000, actor="sre")
    node.refresh_from_db()
    assert memory.aware(node)
    found = memory.room(node, {"step": {1}, "other": {1}})
    assert (found.free_mb, found.where, found.taken) == (
        700.0,
        "the node's 1000 MiB limit",
        [("step v1", 300.0)],
    )
    assert found.fits(600) and not found.fits(700)  # 10 % headroom
    assert found.fits(700, freed=300)


def test_a_gpu_nodes_room_is_its_emptiest_device_as_prometheus_read_it(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.gpus = [{"uuid": "GPU-a"}, {"uuid": "GPU-b"}]  # the poll's inventory: a GPU node
    asked = []

    def answer(query: str) -> list[tuple[dict[str, str], float]]:
        asked.append(query)
        return [
            ({"__name__": f"nv_gpu_memory_{kind}_bytes", "node": "cpu-1", "gpu_uuid": uuid}, v)
            for uuid, used in (("GPU-a", 15 * GIB), ("GPU-b", 4 * GIB))
            for kind, v in (("used", used), ("total", 16 * GIB))
        ]

    monkeypatch.setattr(memory, "instant_query", answer)
    found = memory.room(node, {"step": {1}})
    assert (found.free_mb, found.where) == (12 * 1024, "GPU GPU-b of 16384 MiB")
    assert 'node=~"cpu\\\\-1"' in asked[0] and "timestamp(" in asked[0] and "< 30)" in asked[0]
    monkeypatch.setattr(memory, "instant_query", lambda query: [])
    stale = memory.room(node, {"step": {1}})
    assert stale.free_mb is None and "no reading of the last 30 s" in stale.where

    def away(query: str) -> list:
        raise memory.PrometheusUnavailable("Prometheus at http://p:9090 did not answer")

    monkeypatch.setattr(memory, "instant_query", away)
    assert memory.room(node, {}).where == (
        "its GPUs (unknown: Prometheus at http://p:9090 did not answer)"
    )
    assert memory.refusal(node, "step", {2}, {}) == ""  # unknown room: let through


def test_a_refusal_says_what_is_needed_what_is_free_and_what_to_unload(node: Node) -> None:
    node_set_memory(node_name="cpu-1", limit_mb=700, actor="sre")
    node.refresh_from_db()
    assert memory.refusal(node, "step", {2}, {"step": {1}}) == (
        "does not fit, not sent: step v2 400 MiB (declared) needs 440 MiB with 10% headroom; "
        "the node's 700 MiB limit has 400 MiB free; unloading step v1 (300 MiB) would free "
        "the most"
    )
    assert memory.refusal(node, "step", {3}, {"step": {1}}) == ""  # unknown: let through
    assert memory.refusal(node, "step", {2}, {}) == ""


def test_a_step_that_fits_only_alone_is_unloaded_before_it_loads(node: Node) -> None:
    want = {"pipe": desired("pipe", 2, ensemble=True), "step": desired("step", 2)}
    seen = {"pipe": ready(1), "step": ready(1)}
    tight = memory.Room(400, "test", {("step", 1): (300, ""), ("step", 2): (400, "")})
    assert kinds(plan(want, seen, MANAGED, tight)) == [
        ("unload", "step", ()),  # v2 beside v1 needs 440 of 400 free, v2 alone 440 of 700
        ("load", "step", (2,)),
        ("load", "pipe", (2,)),
    ]
    roomy = memory.Room(2000, "test", {("step", 1): (300, ""), ("step", 2): (400, "")})
    assert kinds(plan(want, seen, MANAGED, roomy))[0] == ("load", "step", (1, 2))
    hopeless = memory.Room(10, "test", {("step", 1): (300, ""), ("step", 2): (400, "")})
    # Fits neither way: planned as usual, and refused with its numbers when it is sent.
    assert kinds(plan(want, seen, MANAGED, hopeless))[0] == ("load", "step", (1, 2))


class Reports:
    """Triton's statistics at the client's boundary: what the backend says a version holds."""

    def __init__(self, **held: int) -> None:
        self.held = held

    def memory_usage(self, model: str, version: int) -> dict[str, int]:
        return self.held


def test_a_measurement_is_the_memory_taken_by_the_load_averaged(
    node: Node, monkeypatch: pytest.MonkeyPatch, settings: object
) -> None:
    settings.FLEET_FOOTPRINT_SETTLE_S = 0  # type: ignore[attr-defined]
    readings = iter([1300.0, 800.0, 1200.0])  # after each load
    monkeypatch.setattr(memory, "used_mb", lambda node: next(readings))
    assert memory.measuring(node, "step", 2)
    silent = Reports()  # the Python backend's: it reports no memory
    memory.measure(node, silent, "step", 2, before_mb=1000)  # type: ignore[arg-type]
    memory.measure(node, silent, "step", 2, before_mb=1000)  # type: ignore[arg-type]  # down
    memory.measure(node, silent, "step", 2, before_mb=1000)  # type: ignore[arg-type]
    found = Footprint.objects.get(model_name="step", version=2, device="cpu")
    assert (found.mb, found.samples, found.source) == (250.0, 2, "metrics")
    Footprint.objects.filter(pk=found.pk).update(samples=3)
    assert not memory.measuring(node, "step", 2)


def test_what_the_backend_reports_it_holds_is_its_footprint_on_that_device(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memory, "used_mb", lambda node: pytest.fail("no need to read the node"))
    reports = Reports(GPU=3 * GIB, CPU=GIB, CPU_PINNED=GIB // 2)  # TensorRT on a GPU, say
    memory.measure(node, reports, "step", 2, before_mb=1000)  # type: ignore[arg-type]
    cpu = Footprint.objects.get(model_name="step", version=2, device="cpu")
    assert (cpu.mb, cpu.source) == (1536.0, "backend")  # host memory, pinned included
    node.gpus = [{"uuid": "GPU-a"}]
    memory.measure(node, reports, "step", 2, before_mb=1000)  # type: ignore[arg-type]
    gpu = Footprint.objects.get(model_name="step", version=2, device="gpu")
    assert (gpu.mb, gpu.source) == (3072.0, "backend")


def test_the_memory_in_use_is_read_from_tritons_metrics(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "# TYPE nv_cpu_memory_used_bytes gauge\nnv_cpu_memory_used_bytes 2147483648\n"
    monkeypatch.setattr(memory, "read_metrics", lambda url, node: text)
    assert memory.used_mb(node) == 2048
    node.gpus = [{"uuid": "GPU-a", "total": GIB, "used": 0}]
    text = (
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-a"} 1073741824\n'
        'nv_gpu_memory_used_bytes{gpu_uuid="GPU-b"} 1073741824\n'
    )
    assert memory.used_mb(node) == 2048  # both devices
    monkeypatch.setattr(memory, "read_metrics", lambda url, node: "")
    node.gpus = []
    assert memory.used_mb(node) is None


def test_limits_and_estimates_are_set_audited_and_checked(node: Node) -> None:
    call_command("set_memory", "--node", "cpu-1", "--limit-mb", "2048")
    call_command("set_memory", "--model-version", "step:3", "--mb", "512")
    assert Node.objects.get(name="cpu-1").memory_limit_mb == 2048
    assert ModelVersion.objects.get(version=3).memory_mb == 512
    assert set(AuditEvent.objects.values_list("action", flat=True)) == {
        "node.set_memory",
        "version.set_memory",
    }
    with pytest.raises(FleetError, match="no node 'nope'"):
        node_set_memory(node_name="nope", limit_mb=1, actor="sre")
    with pytest.raises(CommandError, match="expected MODEL:VERSION"):
        call_command("set_memory", "--model-version", "step", "--mb", "5")
    with pytest.raises(CommandError, match="give --node with --limit-mb"):
        call_command("set_memory", "--node", "cpu-1")
    call_command("set_memory", "--node", "cpu-1", "--limit-mb", "0")
    assert Node.objects.get(name="cpu-1").memory_limit_mb is None


@pytest.fixture
def tight(node: Node) -> Node:
    """cpu-1 serving step v1 (300 MiB measured) in 400 MiB; cpu-2 beside it, with no limit."""
    ModelVersion.objects.filter(model__name="step").update(status=ModelVersion.Status.PUBLISHED)
    node_set_memory(node_name="cpu-1", limit_mb=400, actor="sre")
    Node.objects.filter(pk=node.pk).update(
        index=[{"model": "step", "version": "1", "state": "READY", "reason": ""}]
    )
    Node.objects.create(name="cpu-2", pool=node.pool, http_url="http://cpu-2:8000")
    return node


def test_the_capacity_page_shows_each_nodes_room_and_what_will_not_fit(
    tight: Node, admin_client: object
) -> None:
    node, other = tight, Node.objects.get(name="cpu-2")
    deployment_set(model_name="step", version=2, pool=node.pool, actor="ops")
    page = admin_client.get("/pools/cpu/capacity/").content.decode()  # type: ignore[attr-defined]
    # cpu-1: 400 less step v1's 300 measured; step v2 (400 declared, 440 with headroom) to load,
    # which does not fit even once v1 is unloaded first.
    assert (
        "Will not fit:</strong> cpu-1 needs 400 MiB for step v2, has 100 MiB free, 300 more once"
        " it unloads what it switches from"
    ) in page
    assert "step v1 (300 MiB)" in page and "the node&#x27;s 400 MiB limit" in page
    assert f'id="capacity-{other.name}"' in page  # no limit: unknown room, anything fits
    rows = page.split('id="capacity-')
    assert "does not fit" in rows[1] and "fits" in rows[2] and "unknown" in rows[2]


def test_the_capacity_warning_covers_the_whole_pool_not_one_page(
    node: Node, admin_client: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.fleet import views

    monkeypatch.setattr(views, "CAPACITY_PER_PAGE", 2)
    ModelVersion.objects.filter(model__name="step").update(status=ModelVersion.Status.PUBLISHED)
    for n in range(2, 9):  # cpu-1 (no limit) and cpu-2 on the first page; 7 short nodes
        Node.objects.create(
            name=f"cpu-{n}", pool=node.pool, http_url="http://x:8000", memory_limit_mb=100
        )
    deployment_set(model_name="step", version=2, pool=node.pool, actor="ops")
    page = admin_client.get("/pools/cpu/capacity/").content.decode()  # type: ignore[attr-defined]
    assert page.count('id="capacity-') == 2
    warning = page.split('id="short"')[1].split("</div>")[0]
    assert "cpu-2 needs" in warning and "cpu-6 needs" in warning and "cpu-7" not in warning
    assert "; and 2 more nodes. Those loads would be refused" in warning


def test_the_deploy_form_warns_of_the_nodes_a_release_will_not_fit_before_it_is_sent(
    tight: Node, admin_client: object
) -> None:
    node = tight
    page = admin_client.get("/deployments/").content.decode()  # type: ignore[attr-defined]
    assert 'hx-get="/pools/cpu/fit/" hx-trigger="change" hx-target="#fit-cpu"' in page

    def fit(choice: str) -> str:
        url = f"/pools/cpu/fit/?model_version={choice}"
        return admin_client.get(url).content.decode()  # type: ignore[attr-defined]

    # step v2 (400 declared, 440 with headroom) in 400 MiB, even once v1 (300) is unloaded.
    assert "<strong>Will not fit</strong> beside what they serve: cpu-1 needs 440 MiB with" in (
        warned := fit("step:2")
    )
    assert (
        "the node&#x27;s 400 MiB limit has 100 MiB free, 300 more once it unloads what it"
        " switches from. Those loads would be refused"
    ) in warned
    assert "cpu-2" not in warned and 'href="/pools/cpu/capacity/"' in warned
    node_page = admin_client.get("/nodes/cpu-1/").content.decode()  # type: ignore[attr-defined]
    assert 'hx-get="/pools/cpu/fit/?node=cpu-1" hx-trigger="change"' in node_page
    # The node's own load form asks about the node alone.
    assert "cpu-1 needs 440 MiB" in fit("step:2&node=cpu-1")
    assert "Will not fit" not in fit("step:2&node=cpu-2")
    node_set_memory(node_name="cpu-1", limit_mb=600, actor="sre")
    assert "Will not fit" not in fit("step:2")  # v1 unloads first: v2 fits alone
    assert "Will not fit" not in fit("step:1")  # it serves it already
    assert "Will not fit" not in fit("step:3")  # no footprint known: let through, measured
    assert "Will not fit" not in fit("nonsense")
    node_set_memory(node_name="cpu-1", limit_mb=400, actor="sre")
    deployment_set(model_name="step", version=2, pool=node.pool, actor="ops")  # short already
    assert "Will not fit" not in fit("step:2")  # adds nothing: the memory page says it


def test_a_refused_load_is_sent_anyway_when_an_operator_gives_a_reason(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.fleet.models import Operation
    from apps.fleet.runner import node_run
    from apps.fleet.services.nodes import operation_override
    from apps.fleet.triton import IndexEntry, TritonClient

    sent: list[str] = []
    monkeypatch.setattr(TritonClient, "load", lambda self, model, config_json: sent.append(model))
    served: list[IndexEntry] = []
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: served)
    monkeypatch.setattr(memory, "used_mb", lambda node: None)
    node_set_memory(node_name="cpu-1", limit_mb=100, actor="sre")
    Operation.objects.create(
        node=node, kind="load", model_name="step", versions=[2], requested_by="ops"
    )
    node_run(node_id=node.pk)
    refused = Operation.objects.get()
    assert (refused.status, refused.failure, sent) == ("failed", "memory", [])
    with pytest.raises(FleetError, match="needs a reason"):
        operation_override(operation_id=refused.pk, reason=" ", actor="ops")
    with pytest.raises(FleetError, match="was not refused for want of memory"):
        operation_override(operation_id=refused.pk + 1, reason="x", actor="ops")
    forced = operation_override(operation_id=refused.pk, reason="v1 is leaving", actor="ops")
    served.append(IndexEntry("step", 2, "READY", ""))  # what Triton shows once it loaded
    node_run(node_id=node.pk)
    forced.refresh_from_db()
    assert (forced.status, forced.override, sent) == ("succeeded", "v1 is leaving", ["step"])
    event = AuditEvent.objects.get(action="operation.override", result="ok")
    assert event.message == "v1 is leaving" and event.after["refused"] == refused.pk


def test_a_limit_set_after_a_run_read_its_node_still_holds_for_its_loads(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.fleet.models import Operation
    from apps.fleet.runner import DesiredDigest, node_run
    from apps.fleet.triton import TritonClient

    sent: list[str] = []
    monkeypatch.setattr(TritonClient, "load", lambda self, model, config_json: sent.append(model))
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    wanted = DesiredDigest()
    wanted.node = Node.objects.select_related("pool").get(pk=node.pk)  # as a plan read it
    node_set_memory(node_name="cpu-1", limit_mb=100, actor="sre")  # then: step v2 takes 400
    Operation.objects.create(
        node=node, kind="load", model_name="step", versions=[2], requested_by="ops"
    )
    node_run(node_id=node.pk, wanted=wanted)
    assert (Operation.objects.get().failure, sent) == ("memory", [])


def test_a_load_is_measured_only_when_nothing_else_changes_meanwhile(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    from apps.fleet.models import Operation
    from apps.fleet.runner import _memory_check
    from apps.fleet.triton import IndexEntry

    class Client:  # Triton's index, at the client's boundary
        def __init__(self, *entries: IndexEntry) -> None:
            self.entries = list(entries)

        def repository_index(self) -> list[IndexEntry]:
            return self.entries

    monkeypatch.setattr(memory, "used_mb", lambda node: 1000.0)
    node_set_memory(node_name="cpu-1", limit_mb=100_000, actor="sre")
    op = Operation(node=node, kind="load", model_name="step", versions=[1, 2])
    v1 = IndexEntry("step", 1, "READY", "")
    assert _memory_check(node, Client(v1), op) == ("", (2, 1000.0))  # v2 added, alone
    both = Operation(node=node, kind="load", model_name="step", versions=[2, 3])
    assert _memory_check(node, Client(), both) == ("", None)  # two at once: whose memory?
    switch = Operation(node=node, kind="load", model_name="step", versions=[2])
    assert _memory_check(node, Client(v1), switch) == ("", None)  # v1 ends meanwhile
    leaving = IndexEntry("other", 1, "UNLOADING", "")
    assert _memory_check(node, Client(v1, leaving), op) == ("", None)


def test_tritons_statistics_are_summed_by_kind_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import tritonclient.http as httpclient

    from apps.fleet.triton import TritonClient

    usage = [
        {"type": "GPU", "id": 0, "byte_size": 2 * GIB},
        {"type": "GPU", "id": 1, "byte_size": GIB},  # a model spread over two GPUs
        {"type": "CPU", "id": 0, "byte_size": 1024},
    ]
    stats = {"model_stats": [{"name": "step", "version": "2", "memory_usage": usage}]}
    asked = []

    def answer(self: object, model_name: str, model_version: str) -> dict:
        asked.append((model_name, model_version))
        return stats

    monkeypatch.setattr(httpclient.InferenceServerClient, "get_inference_statistics", answer)
    found = TritonClient("http://127.0.0.1:8000").memory_usage("step", 2)
    assert (found, asked) == ({"GPU": 3 * GIB, "CPU": 1024}, [("step", "2")])


def test_with_prometheus_away_a_gpu_node_is_judged_by_its_own_recent_reading_and_says_so(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The poll reads the node's own /metrics: its GPUs, and when.
    text = "".join(
        f'nv_gpu_memory_{kind}_bytes{{gpu_uuid="{uuid}"}} {value}\n'
        for uuid, used in (("GPU-a", 15 * GIB), ("GPU-b", 14 * GIB))
        for kind, value in (("used", used), ("total", 16 * GIB))
    )
    node.metrics_url = "http://cpu-1:8002/metrics"
    node.save(update_fields=["metrics_url"])
    monkeypatch.setattr(polling, "read_metrics", lambda url, node: text)
    monkeypatch.setattr(TritonClient, "health", lambda self: "ready")
    monkeypatch.setattr(TritonClient, "server_metadata", lambda self: ServerMetadata("2.51.0", []))
    monkeypatch.setattr(TritonClient, "repository_index", lambda self: [])
    node = polling.node_poll(node_id=node.pk)
    assert node.gpus_read_at is not None and len(node.gpus) == 2

    def away(query: str) -> list:
        raise memory.PrometheusUnavailable("Prometheus at http://p:9090 did not answer")

    monkeypatch.setattr(memory, "instant_query", away)
    node = Node.objects.get(pk=node.pk)
    found = memory.room(node, {})
    assert (found.free_mb, found.where) == (
        2 * 1024,
        "GPU GPU-b of 16384 MiB (from the node's own metrics, Prometheus is away)",
    )
    ModelVersion.objects.filter(version=3).update(memory_mb=4096)
    assert memory.refusal(node, "step", {3}, {}).endswith(
        "(from the node's own metrics, Prometheus is away) has 2048 MiB free"
    )
    # A reading older than Prometheus' would have to be decides nothing.
    old = timezone.now() - timedelta(seconds=settings.FLEET_MEMORY_MAX_AGE_S + 1)
    Node.objects.filter(pk=node.pk).update(gpus_read_at=old)
    node = Node.objects.get(pk=node.pk)
    assert memory.room(node, {}).where == (
        "its GPUs (unknown: Prometheus at http://p:9090 did not answer)"
    )
    assert memory.refusal(node, "step", {3}, {}) == ""

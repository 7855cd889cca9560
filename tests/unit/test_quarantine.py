"""A hung load told apart from a slow one (the index cross-checked against the model's own
readiness), and a quarantined node on its page; the hang itself, on the simulator, is in
tests/integration/test_quarantine.py."""

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from apps.accounts.roles import Role
from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.quarantine import stuck
from apps.fleet.runner import node_run
from apps.fleet.triton import IndexEntry, TritonClient, TritonTimeout, TritonUnreachable
from tests.support.users import make_user

pytestmark = pytest.mark.django_db


class Answers(TritonClient):
    """Triton's answers, as given: the boundary."""

    def __init__(self, index: list[IndexEntry], ready: bool = False) -> None:
        super().__init__("http://10.0.0.1:8000", node="gpu-1")
        self.index, self.ready = index, ready

    def repository_index(self) -> list[IndexEntry]:
        if not self.index:
            raise TritonUnreachable("gpu-1", "connection refused")
        return self.index

    def version_ready(self, model: str, version: int) -> bool:
        return self.ready


def load(versions: list[int]) -> Operation:
    return Operation(kind="load", model_name="embedder", versions=versions)


def test_a_load_still_loading_and_not_ready_is_stuck() -> None:
    client = Answers(
        [IndexEntry("embedder", 2, "LOADING", ""), IndexEntry("embedder", 1, "READY", "")]
    )
    assert stuck(client, load([2])).startswith("embedder v2 still LOADING 120 s after its load")


def test_an_index_behind_the_model_itself_is_not_taken_for_a_hang() -> None:
    assert stuck(Answers([IndexEntry("embedder", 2, "LOADING", "")], ready=True), load([2])) == ""


def test_a_load_that_ended_or_a_node_that_cannot_say_is_not_stuck() -> None:
    assert stuck(Answers([IndexEntry("embedder", 2, "UNAVAILABLE", "oom")]), load([2])) == ""
    assert stuck(Answers([]), load([2])) == ""  # unreadable: an unknown outcome, as before


@pytest.fixture
def quarantined() -> Node:
    pool = NodePool.objects.create(name="gpu")
    return Node.objects.create(
        name="gpu-1",
        pool=pool,
        http_url="http://10.0.0.1:8000",
        stage=Node.Stage.QUARANTINED,
        stage_changed_at=timezone.now(),
        stage_reason="embedder v2 still LOADING 120 s after its load was sent",
    )


def test_a_quarantined_node_says_why_on_its_page_and_an_operator_releases_it(
    client: Client, quarantined: Node
) -> None:
    operator: User = make_user(Role.OPERATOR)
    client.force_login(operator)
    page = client.get("/nodes/gpu-1/").content.decode()
    assert "Quarantined" in page and "embedder v2 still LOADING" in page
    assert 'value="clear"' in page
    listed = client.get("/nodes/").content.decode()
    assert "1 quarantined" in listed and 'class="badge stage-quarantined"' in listed
    form = {"kind": "clear", "reason": "restarted it by hand"}
    client.post("/nodes/gpu-1/operate/", form)
    assert Node.objects.get().stage == Node.Stage.JOINING
    assert AuditEvent.objects.get(action="node.clear").actor == operator.username


def test_a_viewer_sees_no_release_and_may_not_release(
    client: Client, quarantined: Node, viewer: User
) -> None:
    client.force_login(viewer)
    assert 'value="clear"' not in client.get("/nodes/gpu-1/").content.decode()
    response = client.post("/nodes/gpu-1/operate/", {"kind": "clear", "reason": "why not"})
    assert response.status_code == 403
    assert Node.objects.get().stage == Node.Stage.QUARANTINED


def test_a_hung_load_stops_the_run_before_a_persons_next_operation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A person's operations run whatever came before them, except on a node quarantined
    meanwhile: it gets no further work until a person or a restart clears it."""
    node = Node.objects.create(
        name="gpu-1", pool=NodePool.objects.create(name="gpu"), http_url="http://10.0.0.1:8000"
    )
    first, second = (
        Operation.objects.create(
            node=node, kind="load", model_name=name, versions=[1], seq=seq, requested_by="ops"
        )
        for seq, name in enumerate(["embedder", "reranker"])
    )
    sent: list[str] = []

    def load(self: TritonClient, model: str, **_: object) -> None:
        sent.append(model)
        raise TritonTimeout("gpu-1", "timed out")

    monkeypatch.setattr(TritonClient, "load", load)
    monkeypatch.setattr(
        TritonClient, "repository_index", lambda self: [IndexEntry("embedder", 1, "LOADING", "")]
    )
    monkeypatch.setattr(TritonClient, "version_ready", lambda self, model, version: False)
    node_run(node_id=node.pk)
    assert sent == ["embedder"]
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.status, first.failure) == (Operation.Status.FAILED, "stuck")
    assert second.status == Operation.Status.QUEUED and second.started_at is None
    assert Node.objects.get().stage == Node.Stage.QUARANTINED


def test_a_load_hung_on_every_node_quarantines_no_more_than_a_share_of_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A third of the trio at most (one node): the second node's hang is the change's, and that
    node keeps serving what it served; its run stops there all the same."""
    pool = NodePool.objects.create(name="trio")
    nodes = [
        Node.objects.create(name=f"trio-{n}", pool=pool, http_url=f"http://10.0.0.{n}:8000")
        for n in (1, 2, 3)
    ]
    for node in nodes[:2]:
        Operation.objects.create(
            node=node, kind="load", model_name="embedder", versions=[2], requested_by="ops"
        )

    def load(self: TritonClient, model: str, **_: object) -> None:
        raise TritonTimeout(self.node, "timed out")

    monkeypatch.setattr(TritonClient, "load", load)
    monkeypatch.setattr(
        TritonClient, "repository_index", lambda self: [IndexEntry("embedder", 2, "LOADING", "")]
    )
    monkeypatch.setattr(TritonClient, "version_ready", lambda self, model, version: False)
    for node in nodes[:2]:
        node_run(node_id=node.pk)
    stages = dict(Node.objects.values_list("name", "stage"))
    assert stages == {"trio-1": "quarantined", "trio-2": "serving", "trio-3": "serving"}
    second = Operation.objects.get(node__name="trio-2")
    assert (second.status, second.failure) == (Operation.Status.FAILED, "stuck")
    assert second.error == (
        "embedder v2 still LOADING 120 s after its load was sent, and not ready: a hung load, "
        "on 2 nodes of pool trio now: more than 1 quarantined would take the pool out of "
        "traffic, so this node keeps serving what it served and the change stops here"
    )
    assert AuditEvent.objects.filter(action="node.quarantine").count() == 1

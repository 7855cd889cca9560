"""A whole release through the API only, as a CI pipeline would drive it, on the real local
fleet (3 Triton nodes, Prometheus, worker and beat): import the repository, register and release
rag_pipeline v2, deploy v1, gray-roll v2 out, poll until it succeeds."""

import io
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import requests

from apps.accounts.roles import Role
from apps.accounts.services import token_create
from apps.audit.models import AuditEvent
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.fleet.services.nodes import node_register
from tests.support.fleet import ANALYSIS, STEPS_V1, STEPS_V2, converged, traffic_to, wait_for
from tests.support.services import Celery
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base, self.session = f"{base}/api", requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def __call__(self, method: str, path: str, expect: int = 200, **kwargs: Any) -> Any:
        response = self.session.request(method, self.base + path, timeout=30, **kwargs)
        assert response.status_code == expect, (method, path, response.text)
        return response.json() if response.content else None

    def poll(self, path: str, done: Any, timeout: float = 150) -> Any:
        deadline = time.monotonic() + timeout
        while not done(found := self("GET", path)):
            assert time.monotonic() < deadline, f"{path} did not get there: {found}"
            time.sleep(1)
        return found


def archive_without_later_pipelines(repository: Path) -> bytes:
    """The repository without rag_pipeline's later versions: v2 is what the pipeline registers."""
    versions = (repository / "rag_pipeline").iterdir()
    later = [path for path in versions if path.is_dir() and path.name != "1"]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(repository.rglob("*")):
            skipped = "__pycache__" in path.parts or any(d in path.parents for d in later)
            if path.is_file() and not skipped:
                archive.write(path, path.relative_to(repository))
    return buffer.getvalue()


def test_a_pipeline_releases_v2_through_the_api_only(
    trio: tuple[Devfleet, FleetState],
    repository: Path,
    celery: Celery,
    live_server: Any,
) -> None:
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    for proc in state.nodes:  # the fleet exists before any release
        node_register(name=proc.name, pool="trio", actor="system:test", **state.node_urls(proc))
    _, token = token_create(user=make_user(Role.RELEASE_MANAGER), name="ci", actor="system:test")
    api = Api(str(live_server), token)

    files = {"archive": ("repository.zip", archive_without_later_pipelines(repository))}
    imported = api("POST", "/import", files=files)
    assert all(result["ok"] for result in imported), imported
    assert [v["version"] for v in api("GET", "/models/rag_pipeline")["versions"]] == [1]

    pbtxt = (repository / "rag_pipeline" / "2" / "config.pbtxt").read_text()
    checked = api("POST", "/models/rag_pipeline/validate", json={"pbtxt": pbtxt})
    assert checked["valid"], checked
    draft = api("POST", "/models/rag_pipeline/versions", 201, json={"pbtxt": pbtxt, "version": 2})
    assert draft["status"] == "draft"
    api("POST", "/models/rag_pipeline/versions/2/status", json={"status": "published"})

    body = {"model": "rag_pipeline", "version": 1, "pool": "trio"}
    deployment = api("POST", "/deployments", 201, json=body)
    api.poll(f"/deployments/{deployment['id']}", lambda d: d["converged"])

    plan = {"model": "rag_pipeline", "pool": "trio", "canary_version": 2}
    # The API's path is under test here, not the judge (tests/integration/test_rollouts.py): a
    # canary's first requests after its load can be slow, and Triton's P99 summary keeps them
    # for its whole age window (issue 17), which once rolled this healthy release back in CI.
    analysis = {**ANALYSIS, "p99_margin_ms": 1000}
    plan |= {"plan": "1 node, hold 6s\n100%", "analysis": analysis}
    with traffic_to(state):
        rollout = api("POST", "/rollouts", 201, json=plan)
        final = api.poll(
            f"/rollouts/{rollout['id']}",
            lambda r: r["state"] in ("succeeded", "rolled_back", "failed", "paused"),
            timeout=180,
        )
    assert final["state"] == "succeeded", final["reason"]
    assert {m["verdict"] for m in final["measurements"]} >= {"success"}
    # v1 stays loaded beside v2 for the pool's rollback window (the default, 15 minutes).
    pool = NodePool.objects.get(name="trio")
    wait_for("v2 is READY on every node", converged(pool, STEPS_V1 | STEPS_V2))
    promoted = api("GET", f"/deployments/{deployment['id']}")
    assert (promoted["version"], promoted["baseline_version"]) == (2, 1)
    # Every change is in the trail under the token's owner.
    mine = set(
        AuditEvent.objects.filter(actor="release_manager-user").values_list("action", flat=True)
    )
    assert {
        "version.create",
        "version.set_status",
        "deployment.set",
        "rollout.start",
    } <= mine

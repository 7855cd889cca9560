"""Tuning as a release on 3 real Triton nodes under the same load each, judged from a real
Prometheus by the real worker and beat: the reranker, one instance made slow, is named the
pipeline's bottleneck with its queue and compute times and advised more instances; accepted on
the page, the tuning rollout shows the pipeline serving more requests a node at no worse P99."""

import re
from html import unescape
from pathlib import Path

import pytest
from django.test import Client

from apps.accounts.roles import Role
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import FleetState
from apps.fleet.models import NodePool
from apps.registry.models import ModelVersion
from apps.rollouts.models import Measurement, Rollout
from apps.rollouts.services import template_save
from tests.support.fleet import ANALYSIS, HEALTHY, saturating, until_state, wait_for
from tests.support.users import make_user

pytestmark = [pytest.mark.integration, pytest.mark.django_db(transaction=True)]

# A request spends this long in the reranker (one instance a node); every node has as many users
# as three of its full batches (8), so requests queue for two batches behind the one computing.
DELAY_MS = 100
USERS_A_NODE = 24
THROUGHPUT = "quality: rag_pipeline requests/s a node"


def test_a_slowed_step_is_named_advised_and_its_tuning_raises_throughput_at_no_worse_p99(
    serving_v1: NodePool,
    trio: tuple[Devfleet, FleetState],
    repository: Path,
    client: Client,
    settings: object,
) -> None:
    devfleet, state = trio
    settings.REGISTRY_ARTIFACT_ROOTS = [str(repository)]  # type: ignore[attr-defined]
    # Once the canary is READY, its users' requests queued behind the old instance drain first.
    paced = ANALYSIS | HEALTHY | {"warmup_s": 15}
    template_save(name="test-pace", analysis=paced, actor="system:test")
    client.force_login(make_user(Role.RELEASE_MANAGER))
    page = "/metrics/bottleneck/rag_pipeline/?pool=trio"
    devfleet.fault("reranker", delay_ms=DELAY_MS)
    try:
        with saturating(state, per_node=USERS_A_NODE) as load:
            wait_for(
                "the bottleneck view names the reranker and advises more instances",
                lambda: "Advice: more instances" in client.get(page).content.decode(),
                timeout=90,
            )
            body = unescape(client.get(page).content.decode())
            assert "Slowest step: reranker v1" in body
            slowest = body.split('id="slowest"')[1].split("</section>")[0]
            queue, compute = map(float, re.findall(r"([\d.]+) ms (?:waiting|computing)", slowest))
            assert queue > 2 * compute > 0, slowest
            change = re.search(r"Advice: (more instances: 1 -> \d+)", body)
            assert change, body
            response = client.post(
                "/rollouts/tune/rag_pipeline/",
                {
                    "pool": "trio",
                    "step": "reranker",
                    "change": change[1],
                    "plan": "1 node, hold 26s\n100%",
                    "template": "test-pace",
                },
            )
            assert response.status_code == 302, response.content.decode()
            rollout = Rollout.objects.get()
            rollout = until_state(rollout, Rollout.State.SUCCEEDED, Rollout.State.ROLLED_BACK)
            assert rollout.state == Rollout.State.SUCCEEDED, rollout.reason
        assert not [k for k in load.answered if k.endswith("failed")], load.answered
    finally:
        devfleet.fault("reranker")
    tuned = ModelVersion.objects.get(model__name="reranker", version=rollout_step(rollout))
    assert tuned.config["instance_group"][0]["count"] >= 2
    # The evidence of the canary's step: the canary node served more requests than each
    # baseline node under the same load, at the same P99 (within a quarter: Triton's summary
    # still holds the canary's first requests, from before its instances were all busy).
    canary_step = Measurement.objects.filter(rollout=rollout, step=0).order_by("taken_at", "id")
    assert {m.verdict for m in canary_step if m.metric == THROUGHPUT} == {"success"}
    last = {m.metric: m for m in canary_step}  # each metric's last round
    assert last[THROUGHPUT].canary_value > 1.3 * last[THROUGHPUT].baseline_value
    assert last["p99"].verdict == "success"
    assert last["p99"].canary_value <= 1.25 * last["p99"].baseline_value


def rollout_step(rollout: Rollout) -> int:
    """The reranker version the rollout's pipeline version pins."""
    config = ModelVersion.objects.get(model=rollout.model, version=rollout.canary_version).config
    (pin,) = [s for s in config["ensemble_scheduling"]["step"] if s["model_name"] == "reranker"]
    return int(pin["model_version"])

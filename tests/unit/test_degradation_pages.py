"""A pool's tiers page: which tier each model serves and why, which are loaded beside it, which
stands by and which is cold, on-call's pin, unpin and confirmation of a switch back from it, and as many queries
for twelve models as for two."""

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts.roles import Role
from apps.degradation.models import Tiers
from apps.degradation.services import tiers_set
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.services.deployments import deployment_set
from apps.registry.models import Model, ModelVersion
from tests.support.registry import import_demo
from tests.support.users import make_user

pytestmark = pytest.mark.django_db
URL = "/pools/demo/tiers/"


@pytest.fixture
def pool() -> NodePool:
    import_demo()
    pool = NodePool.objects.create(name="demo")
    Node.objects.create(name="demo-1", pool=pool, http_url="http://127.0.0.1:1")
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    tiers_set(pool_name="demo", model_name="rag_pipeline", versions=[1, 4], actor="rm")
    Tiers.objects.update(said="rag_pipeline on demo: within budget", said_at=timezone.now())
    return pool


def test_the_page_says_what_each_model_serves_and_why(
    client: Client, pool: NodePool, viewer: User
) -> None:
    client.force_login(viewer)
    page = client.get(URL).content.decode()
    assert 'id="tiers-rag_pipeline"' in page
    assert "primary" in page and "serving" in page and "rag_pipeline on demo: within budget" in page
    assert 'config">standing by</span>' in page  # v4: its steps loaded since the tiers were set
    tiers_set(pool_name="demo", model_name="rag_pipeline", versions=[1, 4, 5], actor="rm")
    page = client.get(URL).content.decode()
    assert 'title="a switch to it loads it first">cold</span>' in page  # v5: two tiers below
    assert "<button>Pin</button>" not in page  # a viewer pins nothing
    assert client.post(f"{URL}rag_pipeline/pin/", {"tier": 1}).status_code == 403


def test_on_call_pins_and_unpins_from_the_page(client: Client, pool: NodePool) -> None:
    client.force_login(make_user(Role.OPERATOR))
    assert "<button>Pin</button>" in client.get(URL).content.decode()
    form = {"tier": "1", "reason": "P99 over budget", "hours": "2"}
    done = client.post(f"{URL}rag_pipeline/pin/", form, follow=True).content.decode()
    assert "rag_pipeline on demo: pinned to tier 1 (v4)" in done
    assert "to tier 1 by operator-user until" in done and "P99 over budget" in done
    assert Deployment.objects.get(pool=pool).version == 4
    assert '<span class="badge warm">loaded beside</span>' in done  # v1, for the way back
    bad = client.post(f"{URL}rag_pipeline/pin/", form | {"hours": "two"}, follow=True)
    assert "tier and hours: numbers" in bad.content.decode()
    refused = client.post(f"{URL}rag_pipeline/pin/", form | {"reason": ""}, follow=True)
    assert "a pin needs a reason" in refused.content.decode()
    unpinned = client.post(f"{URL}rag_pipeline/unpin/", follow=True).content.decode()
    assert "rag_pipeline on demo: unpinned" in unpinned
    assert not Tiers.objects.get().pin_holds()
    assert "Confirm the switch back" not in unpinned
    Tiers.objects.update(cleared=0)  # the automation's probes cleared v1, on a protected pool
    assert "<button>Confirm the switch back</button>" in client.get(URL).content.decode()
    confirmed = client.post(f"{URL}rag_pipeline/confirm/", follow=True).content.decode()
    assert "rag_pipeline on demo: back up to v1" in confirmed
    assert Deployment.objects.get(pool=pool).version == 1


def test_a_release_manager_sets_tiers_from_the_page(client: Client, pool: NodePool) -> None:
    client.force_login(make_user(Role.RELEASE_MANAGER))
    assert "<button>Add tiers</button>" in client.get(URL).content.decode()
    done = client.post(f"{URL}set/", {"model": "rag_pipeline", "versions": "v1, v5"}, follow=True)
    assert "rag_pipeline on demo: tiers v1 &gt; v5" in done.content.decode()
    assert Tiers.objects.get().versions == [1, 5]
    for versions, said in [("one", "numbers separated by commas"), ("5,1", "each newer than")]:
        form = {"model": "rag_pipeline", "versions": versions}
        refused = client.post(f"{URL}set/", form, follow=True).content.decode()
        assert said in refused
    assert Tiers.objects.get().versions == [1, 5]  # a refusal loses nothing


def test_the_page_costs_the_same_queries_for_twelve_models_as_for_two(
    client: Client, pool: NodePool, viewer: User
) -> None:
    client.force_login(viewer)

    def models(count: int) -> None:
        config = ModelVersion.objects.get(model__name="embedder", version=1).config
        for i in range(Tiers.objects.count(), count):
            model = Model.objects.create(name=f"m{i}")
            for number in (1, 2):
                ModelVersion.objects.create(model=model, version=number, config=config)
            Tiers.objects.create(pool=pool, model=model, versions=[1, 2])
            Deployment.objects.create(pool=pool, model=model, version=1)

    counts = []
    for count in (2, 12):
        models(count)
        with CaptureQueriesContext(connection) as seen:
            assert client.get(URL).status_code == 200
        counts.append(len(seen))
    assert counts[0] == counts[1], counts

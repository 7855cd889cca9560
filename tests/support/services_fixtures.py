"""Real services for the integration, browser and benchmark tests: tritonserver nodes,
Prometheus, Redis and a Celery worker, each on free ports, each stopped at the end of the
session whatever happens. A plugin of the root conftest: one of each per session, whichever
directories run."""

import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import POOL_BACKENDS, FleetState, Proc
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.services.nodes import node_register
from apps.fleet.services.pools import pool_set_discoverable, pool_set_traffic
from apps.fleet.triton import TritonClient, TritonError
from apps.registry.imports import repository_import
from apps.rollouts.services import template_save
from controlplane.celery import app as celery_app
from tests.support import REPOSITORY, ROOT
from tests.support.fleet import (
    ANALYSIS,
    HEALTHY,
    STEPS_V1,
    Fleet,
    converged,
    equal,
    runtime,
    traffic_to,
    wait_for,
    weights,
)
from tests.support.services import (
    SCALING_TICK_S,
    Celery,
    Webhook,
    database_url,
    redis_server,
)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    devfleet = Devfleet(home=tmp_path_factory.mktemp("devfleet"), repository=REPOSITORY)
    state = devfleet.up(nodes=2, pool="it", base_port=None, prometheus_port=None)
    try:
        yield Fleet(devfleet=devfleet, state=state)
    finally:
        devfleet.down()


@pytest.fixture(scope="session")
def clients(fleet: Fleet) -> list[TritonClient]:
    """Both nodes serving rag_pipeline v1, loaded through the repository API."""
    nodes = [
        TritonClient(fleet.state.node_urls(p)["http_url"], node=p.name) for p in fleet.state.nodes
    ]
    for client in nodes:
        fleet.devfleet.load_release(client, "rag_pipeline", 1)
    return nodes


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as (_, url):
        yield url


@pytest.fixture(scope="session")
def webhook() -> Iterator[Webhook]:
    server = Webhook()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def celery_processes(
    django_db_setup: None,
    django_db_blocker: object,
    redis_url: str,
    webhook: "Webhook",
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Celery]:
    with django_db_blocker.unblock():  # type: ignore[attr-defined]
        url = database_url()
    celery_app.conf.broker_url = redis_url
    # A test that enqueued before (a page test whose transaction committed) left this process's
    # connection and producer pools on the default broker, where tasks and pings would still go.
    celery_app._pool = None
    celery_app.amqp._producer_pool = None
    processes = Celery(tmp_path_factory.mktemp("celery"), url, redis_url, webhook.url)
    try:
        processes.start_worker()
        processes.start_beat()
        yield processes
    finally:
        processes.stop()


@pytest.fixture
def celery(celery_processes: Celery) -> Iterator[Celery]:
    """The worker and beat for one test: the worker takes tasks during the test and is paused
    when it ends, before the database is emptied."""
    celery_processes.resume()
    yield celery_processes
    celery_processes.pause()


# Three nodes of the (copied) demo repository, for a test module -----------------------------


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the demo repository that tests may add versions to."""
    root = tmp_path_factory.mktemp("repo") / "deploy"
    shutil.copytree(
        ROOT / "deploy" / "models", root / "models", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(
        ROOT / "deploy" / "ragkit", root / "ragkit", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root / "models"


@pytest.fixture(scope="module")
def trio(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Devfleet, FleetState]]:
    devfleet = Devfleet(home=tmp_path_factory.mktemp("trio"), repository=repository)
    state = devfleet.up(nodes=3, pool="trio", base_port=None, prometheus_port=None)
    try:
        yield devfleet, state
    finally:
        devfleet.down()


@pytest.fixture(scope="module")
def haproxy(trio: tuple[Devfleet, FleetState]) -> Proc:
    """HAProxy in front of the trio; stopped with the trio's other processes."""
    return trio[0].balancer()


@pytest.fixture
def pool(trio: tuple[Devfleet, FleetState], repository: Path, celery: Celery) -> Iterator[NodePool]:
    """The trio registered and the demo repository imported; a trio node that died in an
    earlier test (a real crash: the Python backend's stub has died with its shared memory when
    the machine's VM was snapshotted) is started again first, and said in a warning, so that
    one crash fails one test, not the rest of its module."""
    devfleet, state = trio
    names = {proc.name for proc in state.nodes}
    for proc in devfleet.state().nodes:
        if proc.name in names and not proc.running:
            warnings.warn(f"{proc.name} restarted: it exited in an earlier test", stacklevel=1)
            devfleet.restart(proc.name)
    for proc in state.nodes:
        node_register(name=proc.name, pool="trio", actor="system:test", **state.node_urls(proc))
    results = repository_import(path=repository, actor="system:test")
    assert all(r.ok for r in results)
    # No rollback window: a promoted release serves alone at once, as these tests expect (the
    # window has its own tests).
    NodePool.objects.filter(name="trio").update(rollback_window_s=0)
    return NodePool.objects.get(name="trio")


@pytest.fixture
def traffic(trio: tuple[Devfleet, FleetState]) -> Iterator[None]:
    with traffic_to(trio[1]):
        yield


@pytest.fixture
def serving_v1(
    pool: NodePool, trio: tuple[Devfleet, FleetState], celery: Celery, settings: object
) -> NodePool:
    """The pool serving rag_pipeline v1, the worker judging from the trio's Prometheus."""
    _, state = trio
    celery.use_prometheus(state.prometheus_url)
    settings.PROMETHEUS_URL = state.prometheus_url  # type: ignore[attr-defined]
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    wait_for("v1 is READY on every node", v1_everywhere(trio[0], pool), timeout=240)
    return pool


def v1_everywhere(devfleet: Devfleet, pool: NodePool) -> Callable[[], bool]:
    """`converged(pool, STEPS_V1)`, for a fixture's set-up: a node quarantined meanwhile for a
    load that real Triton left LOADING (server#8766: a Python stub started and never heard
    from, seen in CI) is restarted once, as its operator would, and the product releases it
    to join again. Only where its index shows the load still LOADING, and said in a warning;
    never in a test's own waits, where a quarantine is what is tested."""
    on_v1 = converged(pool, STEPS_V1)
    restarted: set[str] = set()

    def check() -> bool:
        for node in pool.nodes.filter(stage=Node.Stage.QUARANTINED).exclude(name__in=restarted):
            try:
                index = TritonClient(node.http_url, node=node.name).repository_index()
            except TritonError:
                continue  # looked at again next time
            if any(entry.state == "LOADING" for entry in index):
                warnings.warn(f"{node.name} restarted: {node.stage_reason}", stacklevel=1)
                devfleet.kill(node.name)
                devfleet.restart(node.name)
                restarted.add(node.name)
        return on_v1()

    return check


@pytest.fixture
def tuning_template(weighted: NodePool, repository: Path, settings: object) -> str:
    """For tunings of the trio's pool, behind HAProxy (its nodes are drained for their loads):
    new versions may get files in its repository, and their rollouts are judged by the template
    named, once the canary's users' queued requests drained."""
    settings.REGISTRY_ARTIFACT_ROOTS = [str(repository)]  # type: ignore[attr-defined]
    paced = ANALYSIS | HEALTHY | {"warmup_s": 15}
    template_save(name="tuning-pace", analysis=paced, actor="system:test")
    return "tuning-pace"


DISCOVERY_GRACE_S = 6


@pytest.fixture
def discovering(weighted: NodePool, celery: Celery) -> Iterator[NodePool]:
    """The weighted trio (registered by hand), and the worker and beat discovering nodes from
    the trio's Prometheus (its `triton` scrape pool) every second, DISCOVERY_GRACE_S of grace."""
    discovery = {"DISCOVERY_SCRAPE_POOL": "triton", "DISCOVERY_INTERVAL_S": "1"}
    discovery["DISCOVERY_GRACE_S"] = str(DISCOVERY_GRACE_S)
    pool_set_discoverable(pool_name=weighted.name, discoverable=True, actor="system:test")
    celery.use_env(**discovery)
    try:
        yield weighted
    finally:
        celery.use_env(**dict.fromkeys(discovery))


@pytest.fixture
def scaling(discovering: NodePool, celery: Celery) -> Iterator[NodePool]:
    """The discovering trio, and beat computing the nodes each pool needs every second, over
    the last 10 s, from the pool's load alone (a queue ratio 100 times the compute time would be
    needed to ask for more: on a CPU shared with other tests, queues are the machine's)."""
    scaling = {"SCALING_TICK_S": "1", "SCALING_WINDOW_S": "10", "SCALING_QUEUE_RATIO": "100"}
    celery.use_env(**scaling)
    try:
        yield discovering
    finally:
        celery.use_env(**(dict.fromkeys(scaling) | {"SCALING_TICK_S": SCALING_TICK_S}))


@pytest.fixture
def weighted(
    pool: NodePool,
    haproxy: Proc,
    trio: tuple[Devfleet, FleetState],
    celery: Celery,
    settings: object,
) -> NodePool:
    """The trio behind HAProxy, serving rag_pipeline v1, every node back in traffic."""
    celery.use_prometheus(trio[1].prometheus_url)
    settings.PROMETHEUS_URL = trio[1].prometheus_url  # type: ignore[attr-defined]
    pool_set_traffic(
        pool_name=pool.name,
        traffic=NodePool.Traffic.HAPROXY,
        runtime=runtime(haproxy).address,
        backends=list(POOL_BACKENDS),
        min_serving=2,
        warmup_requests=3,
        actor="system:test",
    )
    deployment_set(model_name="rag_pipeline", version=1, pool=pool, actor="system:test")
    wait_for("v1 is READY on every node", v1_everywhere(trio[0], pool), timeout=240)
    # Nodes an earlier test left on v1 reload it (what they run is no longer on record): each
    # node's every step loaded by this test, nothing open. Not an exact count of operations: a
    # worker starved of CPU in CI once reloaded a node's pipeline a second time, harmlessly.
    ops = Operation.objects.filter(node__pool=pool)
    loaded = ops.filter(status=Operation.Status.SUCCEEDED).values_list("node_id", "model_name")

    def settled() -> bool:
        done = (
            len(set(loaded.all())) == 3 * len(STEPS_V1)  # read again: `all`, not its cache
            and not ops.filter(status__in=Operation.OPEN).exists()
        )
        return done and weights(haproxy) == equal(trio[1])

    wait_for("every node loaded v1 and is back in traffic", settled)
    return NodePool.objects.get(pk=pool.pk)

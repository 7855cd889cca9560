"""The fleet the integration tests drive: real nodes, what they serve, traffic to them."""

import csv
import io
import json
import random
import shutil
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import HAPROXY_BACKENDS, FleetState, Proc
from apps.devtools.traffic import QUESTIONS, send_traffic, wait_for_model
from apps.fleet.models import Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_set
from apps.fleet.traffic.haproxy import Runtime
from apps.fleet.triton import TritonClient, TritonError, sample_inputs
from apps.prometheus.client import active_targets
from apps.rollouts.models import Rollout
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import rollout_abort
from apps.rollouts.tick import rollout_advance


@dataclass
class Fleet:
    devfleet: Devfleet
    state: FleetState


STEPS_V1 = {
    ("embedder", 1),
    ("retriever", 1),
    ("reranker", 1),
    ("generator", 1),
    ("rag_pipeline", 1),
}
# Short, so that a whole rollout fits in a test: judged every 2 s over the last 10 s, once 5 s of
# warm-up and a whole window have passed since the canary was READY. Everything (3 nodes, traffic, Prometheus, worker) shares 2 cores
# here, so latencies are noisy: a release passes unless 100 ms and 2x worse than its baseline;
# the slow v3 adds 250 ms to every request.
ANALYSIS = {
    "judge": "threshold",  # which these tests' P99 and error ratio are about
    "interval_s": 2,
    "window_s": 10,
    "warmup_s": 5,
    "min_requests": 5,
    "p99_tolerance": 1.0,
    "p99_margin_ms": 100,
}

# Where a healthy release's flow is under test, not the judge (the slow v3 is): a fresh canary's
# first requests can take 200 ms here, and Triton's P99 summary keeps them for its whole age
# window, which rolled healthy releases back in CI (the judge's weakness, issue 17).
HEALTHY = {"p99_margin_ms": 1000}

STEPS_V2 = {
    ("embedder", 2),
    ("retriever", 2),
    ("reranker", 2),
    ("generator", 2),
    ("rag_pipeline", 2),
}
# v2 without its reranker: the degraded chain.
STEPS_V4 = {("embedder", 2), ("retriever", 2), ("generator", 2), ("rag_pipeline", 4)}


def ready_on(node: Node) -> set[tuple[str, int]]:
    client = TritonClient(node.http_url, node=node.name)
    return {
        (e.model, e.version) for e in client.repository_index() if e.state == "READY" and e.version
    }


def wait_for(
    what: str, predicate: Callable[[], bool], timeout: float = 120.0, interval: float = 0.5
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(interval)


def tick_until(
    what: str, rollout: Rollout, done: Callable[[], object], timeout: float = 120
) -> None:
    """The controller ticked here, as the worker would, until `done()`."""

    def ticked() -> bool:
        rollout_advance(rollout_id=rollout.pk)
        return bool(done())

    wait_for(what, ticked, timeout)


def flapping(devfleet: Devfleet, model: str, *, seconds: float) -> Iterator[float]:
    """`model` 400 ms slower for 20 s, then fine for 20 s, over and over for `seconds` (the demo
    models' fault knob): yields at the end of each 20 s (the seconds gone), for the caller to
    look, or stop; healed after."""
    start = time.monotonic()
    try:
        while (elapsed := time.monotonic() - start) < seconds:
            slow = int(elapsed // 20) % 2 == 0
            devfleet.fault(model, delay_ms=400 if slow else 0)
            time.sleep(20 - elapsed % 20)
            yield time.monotonic() - start
    finally:
        devfleet.fault(model)


def converged(pool: NodePool, expected: set[tuple[str, int]]) -> Callable[[], bool]:
    def check() -> bool:
        return all(ready_on(node) == expected for node in pool.nodes.all())

    return check


def settled(pool: NodePool, expected: set[tuple[str, int]]) -> Callable[[], bool]:
    """Every node reads back exactly `expected` READY, and then no operation of the pool is
    open: the loads that brought it there are recorded too (Triton shows a load's result a
    moment before the worker has read it back and said so)."""
    on_it = converged(pool, expected)
    ops = Operation.objects.filter(node__pool=pool, status__in=Operation.OPEN)

    def check() -> bool:
        return on_it() and not ops.exists()

    return check


@contextmanager
def traffic_to(
    state: FleetState, *, through: str = "", balancer: Proc | None = None, rps: float = 8
) -> Iterator[Counter[str]]:
    """Unversioned rag_pipeline requests to every node (or `through` a balancer's URL, or
    through the `balancer`, its streams over its gRPC frontend), 8 per second, while it lasts;
    it starts once the pipeline is served. Yields their outcomes so far, `node ok|failed`."""
    clients = nodes_asked(state)
    if balancer is not None:
        http, grpc = balancer.ports["http"], balancer.ports["grpc"]
        through = f"http://127.0.0.1:{http}"
        clients = [TritonClient(through, node="balancer", grpc=f"127.0.0.1:{grpc}")]
    elif through:
        clients = [TritonClient(through, node="balancer")]
    stop, outcomes = threading.Event(), Counter[str]()

    def run() -> None:
        while not stop.is_set():
            try:
                outcomes.update(
                    send_traffic(clients, model="rag_pipeline", rps=rps, seconds=2, wait=10)
                )
            except TritonError:  # not served at all for a while (a release swapping it)
                stop.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield outcomes
    finally:
        stop.set()
        thread.join(10)


def nodes_asked(state: FleetState) -> list[TritonClient]:
    """A client of each node, its streams over the node's gRPC endpoint."""
    urls = [(p.name, state.node_urls(p)) for p in state.nodes]
    return [TritonClient(u["http_url"], node=name, grpc=u["grpc_url"]) for name, u in urls]


@dataclass
class Load:
    """What `saturating` users were answered: `node ok|failed` counts, and each answer's time."""

    answered: Counter[str] = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)

    def served(self, over_s: float) -> tuple[float, float]:
        """(requests answered a second, their P99 in ms) over the next `over_s` seconds."""
        first = len(self.seconds)
        time.sleep(over_s)
        took = sorted(self.seconds[first:])
        assert took, f"nothing answered in {over_s} s"
        return len(took) / over_s, 1000 * took[min(len(took) - 1, int(0.99 * len(took)))]


@contextmanager
def saturating(state: FleetState, *, per_node: int, haproxy: Proc) -> Iterator[Load]:
    """`per_node` users on each node, each sending unversioned rag_pipeline requests one after
    the other while it lasts: every node under the same load, as busy as its slowest step lets
    it be. A node HAProxy holds at weight 0 (drained for a load) gets no new request until it
    is back, as its share of a balancer's users would not: Triton reloads a version it serves
    only once no request of it is in flight, which a queue kept full never lets happen."""
    clients = nodes_asked(state)
    spec = wait_for_model(clients[0], "rag_pipeline", timeout=30)
    stop, lock, load = threading.Event(), threading.Lock(), Load()
    serving = {client.node: threading.Event() for client in clients}

    def balancer() -> None:
        while True:
            if (now := weights(haproxy)) is not None:  # None: its backends mid-sync
                for node, event in serving.items():
                    if now.get(node, 1):
                        event.set()
                    else:
                        event.clear()
            if stop.wait(0.1):
                break

    def user(client: TritonClient, seed: int) -> None:
        rng = random.Random(seed)
        with client.session(timeout=60) as session:
            while not stop.is_set():
                if not serving[client.node].wait(0.5):
                    continue
                start = time.monotonic()
                try:
                    session.infer("rag_pipeline", sample_inputs(spec, rng, texts=QUESTIONS))
                    outcome = "ok"
                except (TritonError, OSError):
                    outcome = "failed"
                    stop.wait(0.2)
                with lock:
                    load.answered[f"{client.node} {outcome}"] += 1
                    if outcome == "ok":
                        load.seconds.append(time.monotonic() - start)

    watcher = threading.Thread(target=balancer, daemon=True)
    watcher.start()
    users = [
        threading.Thread(target=user, args=(client, n), daemon=True)
        for n, client in enumerate(clients * per_node)
    ]
    for thread in users:
        thread.start()
    try:
        yield load
    finally:
        stop.set()
        for thread in [watcher, *users]:
            thread.join(70)


def until_state(rollout: Rollout, *states: str, timeout: float = 150) -> Rollout:
    try:
        wait_for(
            f"rollout #{rollout.pk} is {' or '.join(states)}",
            lambda: Rollout.objects.get(pk=rollout.pk).state in states,
            timeout,
        )
    finally:
        found = Rollout.objects.get(pk=rollout.pk)
        print(f"\n#{found.pk} {found.state} step {found.step}: {found.reason}")
        for name, stage, why in found.pool.nodes.exclude(stage=Node.Stage.SERVING).values_list(
            "name", "stage", "stage_reason"
        ):
            print(f"  node {name} {stage}: {why}")
        unsucceeded = Operation.objects.filter(node__pool=found.pool).exclude(
            status=Operation.Status.SUCCEEDED
        )
        for op in unsucceeded.select_related("node"):
            print(f"  {op}: {op.status} {op.error}")
        for m in found.measurements.order_by("taken_at")[:40]:
            print(
                f"  {m.taken_at:%H:%M:%S} {m.metric}: {m.canary_value} vs {m.baseline_value}"
                f" (threshold {m.threshold}) {m.verdict} {m.detail}"
            )
    return found


def judged_release(
    pool: NodePool,
    version: int,
    *,
    baseline: int,
    steps: set[tuple[str, int]],
    analysis: dict[str, object],
) -> Rollout:
    """One release of rag_pipeline `version`, from a fresh `baseline` (serving `steps`, nothing
    open), to its end under `analysis`: one the judge paused is aborted, as a person who looked
    would, and one promoted is moved back to the baseline for the next."""
    wait_for(f"a fresh v{baseline} baseline, nothing open", settled(pool, steps), timeout=180)
    rollout = rollout_start(
        model_name="rag_pipeline",
        pool_name=pool.name,
        canary_version=version,
        plan="1 node, hold 10s\n100%",
        analysis=analysis,
        actor="release-manager",
    )
    found = Rollout.objects.filter(pk=rollout.pk)
    decided = [*Rollout.TERMINAL, Rollout.State.PAUSED]
    wait_for(f"rollout #{rollout.pk} ends", lambda: found.get().state in decided, timeout=300)
    ended = found.get()
    print(f"\nv{version} #{ended.pk}: {ended.state} {ended.reason}")
    if ended.state == Rollout.State.PAUSED:
        rollout_abort(rollout_id=ended.pk, actor="release-manager")
        wait_for("aborted", lambda: not found.get().active, timeout=120)
    if ended.state == Rollout.State.SUCCEEDED:
        deployment_set(model_name="rag_pipeline", version=baseline, pool=pool, actor="bench")
    return ended


def runtime(haproxy: Proc) -> Runtime:
    return Runtime(f"127.0.0.1:{haproxy.ports['runtime']}")


def weights(haproxy: Proc) -> dict[str, int] | None:
    """The nodes' weights on HAProxy, when its backends agree on them."""
    found = [runtime(haproxy).weights(backend) for backend in HAPROXY_BACKENDS]
    return found[0] if all(each == found[0] for each in found) else None


def equal(state: FleetState) -> dict[str, int]:
    return {proc.name: 100 for proc in state.nodes}


def served(nodes: list[Proc], state: FleetState, model: str) -> Counter[int]:
    """Requests each version of `model` answered on `nodes`: Triton's own statistics."""
    counts: Counter[int] = Counter()
    for proc in nodes:
        url = f"{state.node_urls(proc)['http_url']}/v2/models/{model}/stats"
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - a local node
            for entry in json.load(response)["model_stats"]:
                counts[int(entry["version"])] += entry["inference_stats"]["success"]["count"]
    return counts


def counted(
    nodes: list[Proc], state: FleetState, model: str, version: int | None, total: int
) -> Counter[int]:
    """`served`, read until Triton's statistics count `total` requests of `version` of `model`
    (of every version: None) on `nodes`. A backend reports a request's statistics after its
    response went out, so a read right after the last answer may miss it (29 of 30, seen in
    CI). What is read then is returned: a count past `total` is for the caller to see."""
    counts: Counter[int] = Counter()

    def reached() -> bool:
        nonlocal counts
        counts = served(nodes, state, model)
        return (sum(counts.values()) if version is None else counts[version]) >= total

    wait_for(f"Triton counted {total} requests of {model}", reached, timeout=10, interval=0.05)
    return counts


@dataclass
class Recorder:
    """Steady unversioned rag_pipeline requests to `url` (a balancer), `rps` a second: when each
    was sent, how long it took, whether it failed."""

    url: str
    rps: float
    sent: list[tuple[float, float, bool]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        client = TritonClient(self.url, node="balancer")
        spec = wait_for_model(client, "rag_pipeline", timeout=60)
        rng = random.Random(0)

        def one(at: float) -> None:
            try:
                client.infer("rag_pipeline", sample_inputs(spec, rng, texts=QUESTIONS))
                ok = True
            except TritonError:
                ok = False
            self.sent.append((at, time.monotonic() - at, ok))

        with ThreadPoolExecutor(max_workers=16) as pool:
            start = time.monotonic()
            for number in range(10**9):
                if self.stop.is_set():
                    break
                time.sleep(max(0.0, start + number / self.rps - time.monotonic()))
                pool.submit(one, time.monotonic())

    def between(self, start: float, end: float) -> list[tuple[float, bool]]:
        return [(took, ok) for at, took, ok in list(self.sent) if start <= at <= end]

    @property
    def failed(self) -> int:
        return sum(1 for _, _, ok in list(self.sent) if not ok)


@contextmanager
def recording(url: str, *, rps: float) -> Iterator[Recorder]:
    """A Recorder sending while the block runs; every request it sent has ended after it."""
    recorder = Recorder(url, rps)
    thread = threading.Thread(target=recorder.run, daemon=True)
    thread.start()
    try:
        yield recorder
    finally:
        recorder.stop.set()
        thread.join(30)


def answered_through(haproxy: Proc, server: str, backend: str = "triton_http") -> int:
    """Responses HAProxy relayed from `server` (health checks are not among them)."""
    answer = runtime(haproxy).command("show stat -1 4 -1").lstrip("# ")
    rows = csv.DictReader(io.StringIO(answer))
    codes = ("hrsp_1xx", "hrsp_2xx", "hrsp_3xx", "hrsp_4xx", "hrsp_5xx", "hrsp_other")
    return sum(
        int(row[code] or 0)
        for row in rows
        if row.get("pxname") == backend and row.get("svname") == server
        for code in codes
    )


@dataclass
class Joined:
    """A node added to a discovering fleet, watched until it took traffic."""

    proc: Proc
    listed_to_serving_s: float  # from Prometheus' targets API listing it to its full weight
    weights_while_joining: list[int | None]  # HAProxy's weight for it, each time it was looked at


def join_watched(
    devfleet: Devfleet, haproxy: Proc, pool: str, held: Callable[[Proc], None] | None = None
) -> Joined:
    """One more node started and listed for Prometheus; returns once the control plane has
    found it, loaded it, let it join and HAProxy gives it its full weight (`held`, when given,
    called first, once Prometheus lists it: it lets the node join)."""
    proc = devfleet.add_node(pool)

    def listed() -> bool:
        return any(t["labels"].get("node") == proc.name for t in active_targets("triton"))

    wait_for(f"Prometheus lists {proc.name}", listed, timeout=60, interval=0.1)
    if held is not None:
        held(proc)
    since = time.monotonic()
    weights: list[int | None] = []

    def serving() -> bool:
        stage = Node.objects.filter(name=proc.name).values_list("stage", flat=True).first()
        weight = runtime(haproxy).weights("triton_http").get(proc.name)
        if stage != Node.Stage.SERVING:
            weights.append(weight)
        return stage == Node.Stage.SERVING and weight == 100

    wait_for(f"{proc.name} found, loaded, warmed and in traffic", serving, interval=0.1)
    return Joined(proc, time.monotonic() - since, weights)


PERF_DRILLS = Path(__file__).parent / "perf_drills"
# rag_pipeline v15 as every node serves it: its reranker 40 ms a request, two instances.
STEPS_V15 = {
    ("embedder", 2),
    ("retriever", 2),
    ("reranker", 7),
    ("generator", 2),
    ("rag_pipeline", 15),
}


def with_perf_drills(repository: Path) -> None:
    """The performance gate's drills added to a copy of the demo repository: reranker v7 (v2
    taking 40 ms a request, two instances) and v8 (the same, one instance: as fast alone, half
    the requests a second under load); rag_pipeline v15 pinning v7, v16 pinning v8, and v17
    pinning v7 again (a healthy release)."""
    shutil.copytree(PERF_DRILLS, repository, dirs_exist_ok=True)

"""A version measured with perf_analyzer on one node, queued here; a worker runs it
(apps/performance/runs.py)."""

from django.db import transaction

from apps.accounts.permissions import authorize
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.models import Deployment, Node, NodePool
from apps.fleet.tasks import send_to
from apps.performance.analyzer import PerfError, SearchError
from apps.performance.models import PerfRun, PerfSearch
from apps.performance.tasks import measure
from apps.performance.tasks import search as search_task
from apps.registry.codec import from_dict, step_names
from apps.registry.ensembles import streams
from apps.registry.models import Model, ModelVersion
from apps.registry.selectors import registry_resolver


@audited("perf.start", lambda *, model_name, **_: f"model:{model_name}", (PerfError,))
def perf_start(
    *,
    node: Node,
    model_name: str,
    version: int,
    concurrencies: tuple[int, int, int],
    requests: int,
    timeout_s: int,
    purpose: str,
    actor: Actor,
) -> PerfRun:
    """Queue a measurement of `model_name` v`version` on `node`; the worker runs it once this
    commits (`concurrencies` as `concurrency_range` gives them). Raises PerfError for a version
    the registry lacks."""
    found = (
        ModelVersion.objects.filter(model__name=model_name, version=version)
        .select_related("model")
        .first()
    )
    if found is None:
        raise PerfError(f"{model_name} v{version} is not in the registry")
    authorize(actor, "performance.add_perfrun", node.pool)
    run = PerfRun.objects.create(
        model=found.model,
        version=version,
        node=node,
        node_name=node.name,
        concurrencies=list(concurrencies),
        requests=requests,
        streaming=streams(from_dict(found.config), registry_resolver()),
        timeout_s=timeout_s,
        purpose=purpose[:200],
        requested_by=actor_name(actor),
    )
    audit_record(
        actor=actor,
        target=f"model:{model_name}",
        after={"perf_run": run.pk, "version": version, "node": node.name, "purpose": purpose},
    )
    queue = node.pool.queue if node.pool_id else ""
    # Robust: with the broker away the run stays queued, and its gate gives up at its deadline.
    transaction.on_commit(lambda: send_to(queue, measure, run.pk), robust=True)
    return run


@audited("perf.search", lambda *, pool_name, **_: f"pool:{pool_name}", (SearchError,))
def search_start(
    *, pipeline: str, pool_name: str, step: str, concurrency: int, requests: int, actor: Actor
) -> PerfSearch:
    """Queue a search of `step`'s config in what `pool_name` serves of `pipeline`, on the
    pool's last serving node by name (a rollout's canary is its first)."""
    pool = NodePool.objects.filter(name=pool_name).first()
    deployed = Deployment.objects.filter(pool=pool, node=None, model__name=pipeline).first()
    if pool is None or deployed is None:
        raise SearchError(f"pool {pool_name} does not run {pipeline}")
    authorize(actor, "performance.add_perfrun", pool)
    serving = ModelVersion.objects.get(model__name=pipeline, version=deployed.version)
    if deployed.model.kind != Model.Kind.ENSEMBLE or step not in step_names(serving.config):
        steps = ", ".join(sorted(step_names(serving.config))) or "none"
        raise SearchError(
            f"{pipeline} v{serving.version} has no step {step!r} (its steps: {steps})"
        )
    if not deployed.model.sample_inputs:
        raise SearchError(f"{pipeline} has no sample inputs: an evaluation set gives it some")
    if not 1 <= concurrency <= 64 or not 10 <= requests <= 10_000:
        raise SearchError("a concurrency from 1 to 64, and 10 to 10,000 requests a trial")
    node = (
        pool.nodes.serving()
        .filter(health=Node.Health.READY)
        .exclude(grpc_url="")
        .order_by("-name")
        .first()
    )
    if node is None:
        raise SearchError(f"pool {pool_name} has no ready node with a gRPC endpoint to search on")
    search = PerfSearch.objects.create(
        pipeline=deployed.model,
        version=deployed.version,
        step=step,
        pool_name=pool.name,
        node=node,
        node_name=node.name,
        concurrency=concurrency,
        requests=requests,
        budget_ms=deployed.model.latency_budget_ms,
        requested_by=actor_name(actor),
    )
    audit_record(
        actor=actor,
        target=f"pool:{pool_name}",
        after={"search": search.pk, "pipeline": pipeline, "step": step, "node": node.name},
    )
    transaction.on_commit(lambda: send_to(pool.queue, search_task, search.pk), robust=True)
    return search

"""A version measured with perf_analyzer on one node, queued here; a worker runs it
(apps/performance/runs.py)."""

from django.db import transaction

from apps.accounts.permissions import authorize
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.models import Node
from apps.fleet.tasks import send_to
from apps.performance.analyzer import PerfError
from apps.performance.models import PerfRun
from apps.performance.tasks import measure
from apps.registry.codec import from_dict
from apps.registry.ensembles import streams
from apps.registry.models import ModelVersion
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

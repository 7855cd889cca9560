"""The automation that steps a pool down its tiers of a model, on its own, when the pipeline
breaks its latency budget or error objective (triggers.judge): one tier at a time, at once,
audited as the system with the evidence. It never acts while a rollout of the model runs on the
pool or a person's pin holds it; and more than DEGRADATION_MAX_SWITCHES_PER_HOUR switches in an
hour freeze it and open an incident, for a person to decide (a flapping fault is never chased
switch by switch)."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.audit.services import audit_record, audited
from apps.degradation.models import Tiers
from apps.degradation.services import _target
from apps.degradation.triggers import Finding, Limits, Reading, judge
from apps.fleet.models import Deployment
from apps.fleet.services.deployments import deployment_set
from apps.incidents.models import Incident
from apps.incidents.services import incident_open, incident_update
from apps.rollouts.services import rollout_owning
from controlplane.catalog import budget_queries
from controlplane.prometheus import PrometheusUnavailable, instant_query

ACTOR = "system:degradation"
HOUR = timedelta(hours=1)


def tick_all() -> list[str]:
    """Every pool's tiers judged once: what each did, in words, kept on its row when it
    changed (the page's "why")."""
    said = []
    for tiers in Tiers.objects.select_related("pool", "model"):
        text = tick(tiers)
        changed = Tiers.objects.filter(pk=tiers.pk).exclude(said=text)
        changed.update(said=text, said_at=timezone.now())
        said.append(text)
    return said


def tick(tiers: Tiers) -> str:
    where = f"{tiers.model.name} on {tiers.pool.name}"
    if tiers.frozen_at is not None:
        return f"{where}: frozen since {tiers.frozen_at:%H:%M:%S}: {tiers.frozen_reason}"
    if tiers.pin_holds():
        return f"{where}: pinned by {tiers.pinned_by}"
    if busy := rollout_owning(tiers.pool, tiers.model):
        return busy
    serving = (
        Deployment.objects.filter(pool=tiers.pool, model=tiers.model)
        .values_list("version", flat=True)
        .first()
    )
    if serving is None or serving not in tiers.versions:
        what = f"serves v{serving}" if serving else "is deployed nowhere"
        return f"{where} {what}, none of its tiers: a person moved it"
    position = tiers.versions.index(serving)
    if position == len(tiers.versions) - 1:
        return f"{where}: at its lowest tier"
    model = tiers.model
    limits = Limits(
        budget_ms=model.latency_budget_ms,
        max_error_ratio=None if model.slo_availability is None else 1 - model.slo_availability,
        min_requests=settings.DEGRADATION_MIN_REQUESTS,
    )
    try:
        short, long = (
            _reading(tiers, window)
            for window in (settings.DEGRADATION_SHORT_S, settings.DEGRADATION_LONG_S)
        )
    except PrometheusUnavailable as exc:
        return f"{where}: {exc}"
    finding = judge(short, long, limits)
    if not finding.breached:
        return f"{where}: {finding.evidence}"
    return _step_down(tiers.pk, serving, finding)


def _reading(tiers: Tiers, window_s: int) -> Reading:
    queries = budget_queries(model=tiers.model.name, pool=tiers.pool.name, window_s=window_s)
    found = {name: instant_query(query) for name, query in queries.items()}
    return Reading(
        window_s,
        *(found[name][0][1] if found[name] else None for name in ("ok", "failed", "p99")),
    )


def _step_down(tiers_id: int, serving: int, finding: Finding) -> str:
    with transaction.atomic():
        tiers = Tiers.objects.select_for_update().select_related("pool", "model").get(pk=tiers_id)
        if tiers.frozen_at or tiers.pin_holds() or rollout_owning(tiers.pool, tiers.model):
            return f"{tiers.model.name} on {tiers.pool.name}: taken over meanwhile"
        now = timezone.now()
        recent = [at for at in tiers.switched_at if datetime.fromisoformat(at) > now - HOUR]
        if len(recent) >= settings.DEGRADATION_MAX_SWITCHES_PER_HOUR:
            return _freeze(tiers, recent, finding, now)
        lower = tiers.versions[tiers.versions.index(serving) + 1]
        tiers.switched_at = [*recent, now.isoformat()]
        tiers.save(update_fields=["switched_at", "updated_at"])
        _degrade(
            pool_name=tiers.pool.name,
            model_name=tiers.model.name,
            tiers=tiers,
            serving=serving,
            lower=lower,
            evidence=finding.evidence,
            actor=ACTOR,
        )
    return f"{tiers.model.name} on {tiers.pool.name}: v{serving} → v{lower}: {finding.evidence}"


@audited("pool.degrade", _target)
def _degrade(
    *,
    pool_name: str,
    model_name: str,
    tiers: Tiers,
    serving: int,
    lower: int,
    evidence: str,
    actor: str,
) -> None:
    """One tier down, now: the pool's deployment names the lower tier's version; the switch is
    told in the open incident of the pool and model, or opens one."""
    deployment_set(model_name=model_name, version=lower, pool=tiers.pool, actor=actor)
    incident = _attach(tiers, f"stepped down v{serving} → v{lower}: {evidence}")
    audit_record(
        actor=actor,
        target=f"pool:{pool_name}:{model_name}",
        before={"version": serving, "tier": tiers.versions.index(serving)},
        after={"version": lower, "tier": tiers.versions.index(lower), "incident": incident.pk},
        message=evidence,
    )


def _attach(tiers: Tiers, what: str, severity: str = Incident.Severity.WARNING) -> Incident:
    """The open (or mitigated) incident of the pool and model with `what` added to its notes,
    at least as severe as `severity`; a new one when there is none."""
    incident = (
        Incident.objects.select_for_update()
        .filter(pool=tiers.pool, model=tiers.model)
        .exclude(status=Incident.Status.RESOLVED)
        .order_by("-started_at")
        .first()
    )
    line = f"{timezone.now():%H:%M:%S} {ACTOR} {what}"
    if incident is None:
        incident = incident_open(
            title=f"{tiers.model.name} on {tiers.pool.name} degraded by itself",
            severity=severity,
            start=timezone.now(),
            actor=ACTOR,
            pool=tiers.pool.name,
            model=tiers.model.name,
        )
    elif severity == Incident.Severity.CRITICAL != incident.severity:
        Incident.objects.filter(pk=incident.pk).update(severity=severity)  # the freeze's event says
    notes = f"{incident.notes}\n{line}" if incident.notes else line
    return incident_update(incident_id=incident.pk, notes=notes, actor=ACTOR)


def _freeze(tiers: Tiers, recent: list[str], finding: Finding, now: datetime) -> str:
    where = f"{tiers.model.name} on {tiers.pool.name}"
    why = (
        f"{len(recent)} switches in the last hour, and the budget broken again: {finding.evidence}"
    )
    tiers.frozen_at, tiers.frozen_reason = now, why
    tiers.save(update_fields=["frozen_at", "frozen_reason", "updated_at"])
    incident = _attach(tiers, f"froze: {why}", Incident.Severity.CRITICAL)
    audit_record(
        actor=ACTOR,
        action="pool.freeze_tiers",
        target=f"pool:{tiers.pool.name}:{tiers.model.name}",
        after={"switched_at": recent, "incident": incident.pk, "severity": incident.severity},
        message=why,
    )
    return f"{where}: frozen: {why}"

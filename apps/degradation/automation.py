"""The automation that steps a pool down its tiers of a model, on its own, when the pipeline
breaks its latency budget or error objective (triggers.judge): one tier at a time, at once,
audited as the system with the evidence; and back up a tier, carefully: once the budget has held
at the lower tier for DEGRADATION_DWELL_UP_S and the tier above has proved itself on probes of
its explicit version (probes.probe). It never acts while a rollout of the model runs on the
pool or a person's pin holds it; and more than DEGRADATION_MAX_SWITCHES_PER_HOUR switches in an
hour freeze it and open an incident, for a person to decide (a flapping fault is never chased
switch by switch)."""

from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from apps.audit.services import audit_record, audited
from apps.degradation.models import Tiers
from apps.degradation.probes import probe
from apps.degradation.services import _target, tier_serve
from apps.degradation.triggers import Limits, Window, judge
from apps.fleet.models import Deployment, Node
from apps.fleet.owners import owner_holding
from apps.incidents.models import Incident
from apps.incidents.services import incident_open, incident_update
from apps.prometheus.catalog import budget_queries
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.registry.codec import step_names
from apps.registry.models import Model, ModelVersion
from apps.rollouts.notify import notify_pool

ACTOR = "system:degradation"
HOUR = timedelta(hours=1)


def tiers_tick(*, tiers_id: int) -> str:
    """One pool's tiers of one model judged once: what it did, in words, kept on its row when it
    changed (the page's "why")."""
    tiers = Tiers.objects.select_related("pool", "model").filter(pk=tiers_id).first()
    if tiers is None:
        return ""  # its tiers were removed since the tick was sent
    text = tick(tiers)
    changed = Tiers.objects.filter(pk=tiers.pk).exclude(said=text)
    changed.update(said=text, said_at=timezone.now())
    return text


def tick(tiers: Tiers) -> str:
    where = f"{tiers.model.name} on {tiers.pool.name}"
    if tiers.frozen_at is not None:
        return f"{where}: frozen since {tiers.frozen_at:%H:%M:%S}: {tiers.frozen_reason}"
    if tiers.pin_holds():
        return f"{where}: pinned by {tiers.pinned_by}"
    if held := owner_holding(tiers.pool, tiers.model):
        return held.why
    deployment = Deployment.objects.filter(pool=tiers.pool, model=tiers.model).first()
    if deployment is None or deployment.version not in tiers.versions:
        what = f"serves v{deployment.version}" if deployment else "is deployed nowhere"
        return f"{where} {what}, none of its tiers: a person moved it"
    serving = deployment.version
    steps = _steps(tiers, serving)
    limits = _limits(tiers.model, steps)
    nodes = list(Node.objects.filter(pool=tiers.pool).in_traffic().values_list("name", flat=True))
    try:
        short, long = (
            _window(tiers, steps, nodes, window)
            for window in (settings.DEGRADATION_SHORT_S, settings.DEGRADATION_LONG_S)
        )
    except PrometheusUnavailable as exc:
        return f"{where}: {exc}"
    finding = judge(short, long, limits)
    position = tiers.versions.index(serving)
    if finding.breached:
        if tiers.judged_from and timezone.now() < tiers.judged_from:
            return (
                f"{where}: v{serving}, {finding.evidence}; but until {tiers.judged_from:%H:%M:%S} "
                "the readings still hold requests from before the last step down or probes: "
                "nothing is decided"
            )
        Tiers.objects.filter(pk=tiers.pk).update(breached_at=timezone.now(), cleared=None)
        if position == len(tiers.versions) - 1:
            return f"{where}: at its lowest tier, v{serving}: {finding.evidence}"
        return _switch(tiers.pk, serving, position + 1, finding.evidence)
    if position == 0 or not finding.measured:
        return f"{where}: {finding.evidence}"
    return _maybe_back_up(tiers, deployment, position, finding.evidence)


def _steps(tiers: Tiers, version: int) -> list[str]:
    """The steps of the pipeline's `version`: their queues are its own (none for a model)."""
    return sorted(step_names(ModelVersion.objects.get(model=tiers.model, version=version).config))


def _limits(model: Model, steps: list[str]) -> Limits:
    """What the pipeline is held to: its budget, its error objective, the saturation limit, and
    each of its LLM steps' first-token objective."""
    objectives = Model.objects.filter(name__in=[model.name, *steps], slo_ttft_ms__isnull=False)
    return Limits(
        budget_ms=model.latency_budget_ms,
        max_error_ratio=None if model.slo_availability is None else 1 - model.slo_availability,
        min_requests=settings.DEGRADATION_MIN_REQUESTS,
        max_queue_ratio=settings.DEGRADATION_MAX_QUEUE_RATIO,
        ttft_ms={m.name: m.slo_ttft_ms for m in objectives if m.slo_ttft_ms},
    )


def _window(tiers: Tiers, steps: list[str], nodes: list[str], window_s: int) -> Window:
    if not nodes:
        return Window(window_s, None, None, None)  # no node serves: nothing to judge
    queries = budget_queries(
        model=tiers.model.name, steps=steps, pool=tiers.pool.name, nodes=nodes, window_s=window_s
    )
    found = {name: instant_query(query) for name, query in queries.items()}
    value = {name: rows[0][1] if rows else None for name, rows in found.items()}
    return Window(
        window_s,
        value["ok"],
        value["failed"],
        value["p99"],
        rejected=value["rejected"],
        queue_us=value["queue_us"],
        compute_us=value["compute_us"],
        queue_held=value["queue_held"],
        ttft_ms={
            labels["model"]: v for labels, v in found["ttft"] if "model" in labels and v == v
        },  # v == v: a quantile of no request is NaN
    )


def _maybe_back_up(tiers: Tiers, deployment: Deployment, position: int, evidence: str) -> str:
    """Back up to the tier above once the budget has held at this one for the dwell (since the
    pool came here, and since it was last breached) and the tier above passes its probes; one
    round of probes a dwell at most, claimed on the row before it is sent."""
    where, serving = f"{tiers.model.name} on {tiers.pool.name}", deployment.version
    above, now = tiers.versions[position - 1], timezone.now()
    dwell = timedelta(seconds=settings.DEGRADATION_DWELL_UP_S)
    held_since = max(filter(None, (deployment.updated_at, tiers.breached_at)))
    said = f"{where}: v{serving} {evidence}"
    if tiers.cleared is not None:
        return f"{said}; {tiers.probed}: a person confirms the switch back (protected pool)"
    if now - held_since < dwell:
        return f"{said}; v{above} is probed from {held_since + dwell:%H:%M:%S} if that holds"
    due = Q(probed_at__isnull=True) | Q(probed_at__lte=now - dwell)
    if not Tiers.objects.filter(due, pk=tiers.pk).update(probed_at=now):
        last = f"{tiers.probed_at:%H:%M:%S}" if tiers.probed_at else "now"
        return f"{said}; probed v{above} at {last}: {tiers.probed or 'under way'}"
    probed = probe(tiers, above)
    # Failed probes' slow requests are in the pipeline's readings for a while.
    settle = {} if probed.passed else {"judged_from": _settled(timezone.now())}
    Tiers.objects.filter(pk=tiers.pk).update(probed=probed.evidence, **settle)
    if not probed.passed:
        return f"{said}; stays: {probed.evidence}"
    if tiers.pool.protected:  # a person confirms each switch back there (services.tier_confirm)
        Tiers.objects.filter(pk=tiers.pk).update(cleared=position - 1)
        return f"{said}; {probed.evidence}: a person confirms the switch back (protected pool)"
    return _switch(tiers.pk, serving, position - 1, probed.evidence)


def _switch(tiers_id: int, serving: int, position: int, evidence: str) -> str:
    """The pool serves tier `position` now, unless something took it over meanwhile or the
    switch would be one too many this hour (a freeze, for a person to decide)."""
    with transaction.atomic():
        tiers = Tiers.objects.select_for_update().select_related("pool", "model").get(pk=tiers_id)
        if tiers.frozen_at or owner_holding(tiers.pool, tiers.model):
            return f"{tiers.model.name} on {tiers.pool.name}: taken over meanwhile"
        # Two ticks may judge the same readings at once (one slower than the period): the one
        # that waited on the lock finds the pool moved, and neither moves nor counts it again.
        now_serving = Deployment.objects.filter(pool=tiers.pool, model=tiers.model)
        current = now_serving.values_list("version", flat=True).first()
        if current != serving:
            return f"{tiers.model.name} on {tiers.pool.name}: serves v{current} already"
        now = timezone.now()
        recent = [at for at in tiers.switched_at if datetime.fromisoformat(at) > now - HOUR]
        if len(recent) >= settings.DEGRADATION_MAX_SWITCHES_PER_HOUR:
            return _freeze(tiers, recent, evidence, now)
        down = position > tiers.versions.index(serving)
        tiers.switched_at = [*recent, now.isoformat()]
        tiers.judged_from = _settled(now) if down else None
        tiers.cleared = None
        tiers.save(update_fields=["switched_at", "judged_from", "cleared", "updated_at"])
        to = tiers.versions[position]
        move = _degrade if down else _restore
        move(
            pool_name=tiers.pool.name,
            model_name=tiers.model.name,
            tiers=tiers,
            serving=serving,
            to=to,
            evidence=evidence,
            actor=ACTOR,
        )
    return f"{tiers.model.name} on {tiers.pool.name}: v{serving} → v{to}: {evidence}"


def _settled(now: datetime) -> datetime:
    """When the pipeline's readings no longer hold the requests sent until `now`: Triton keeps a
    request in its P99 summary for 60 s, and labels every version of an ensemble alike, so after
    a step down (or probes of the tier above) they still tell of the tier before for a while; a
    breach read meanwhile decides nothing (another step down would chase a ghost)."""
    return now + timedelta(seconds=settings.DEGRADATION_SETTLE_S)


def _move(
    *,
    pool_name: str,
    model_name: str,
    tiers: Tiers,
    serving: int,
    to: int,
    evidence: str,
    actor: str,
) -> None:
    """One tier down, or back up, now: told in the open incident of the pool and model (a step
    down opens one where there is none) and by webhook."""
    down = tiers.versions.index(to) > tiers.versions.index(serving)
    tier_serve(tiers, tiers.versions.index(to), actor)
    what = f"{'stepped down' if down else 'stepped back up'} v{serving} → v{to}: {evidence}"
    incident = _attach(tiers, what, opens=down)
    event = "degraded" if down else "restored"
    notify_pool(pool=pool_name, model=model_name, event=event, what=what)
    audit_record(
        actor=actor,
        target=f"pool:{pool_name}:{model_name}",
        before={"version": serving, "tier": tiers.versions.index(serving)},
        after={"version": to, "tier": tiers.versions.index(to)}
        | ({"incident": incident.pk} if incident else {}),
        message=evidence,
    )


# One body, two actions: the way the pool moved names the event.
_degrade = audited("pool.degrade", _target)(_move)
_restore = audited("pool.restore", _target)(_move)


def _attach(
    tiers: Tiers, what: str, severity: str = Incident.Severity.WARNING, *, opens: bool = True
) -> Incident | None:
    """The open (or mitigated) incident of the pool and model with `what` added to its notes,
    at least as severe as `severity`; a new one when there is none and `opens`."""
    incident = (
        Incident.objects.select_for_update()
        .filter(pool=tiers.pool, model=tiers.model)
        .exclude(status=Incident.Status.RESOLVED)
        .order_by("-started_at")
        .first()
    )
    line = f"{timezone.now():%H:%M:%S} {ACTOR} {what}"
    if incident is None:
        if not opens:
            return None
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


def _freeze(tiers: Tiers, recent: list[str], evidence: str, now: datetime) -> str:
    where = f"{tiers.model.name} on {tiers.pool.name}"
    why = f"{len(recent)} switches in the last hour, and another one due: {evidence}"
    tiers.frozen_at, tiers.frozen_reason = now, why
    tiers.save(update_fields=["frozen_at", "frozen_reason", "updated_at"])
    incident = _attach(tiers, f"froze: {why}", Incident.Severity.CRITICAL)
    notify_pool(pool=tiers.pool.name, model=tiers.model.name, event="frozen", what=f"froze: {why}")
    assert incident is not None  # it opens one when there is none
    audit_record(
        actor=ACTOR,
        action="pool.freeze_tiers",
        target=f"pool:{tiers.pool.name}:{tiers.model.name}",
        after={"switched_at": recent, "incident": incident.pk, "severity": incident.severity},
        message=why,
    )
    return f"{where}: frozen: {why}"

"""Incidents: opened by people from a window, or by Alertmanager from firing alerts, followed to
their resolution. Every change is audited; a suspect's rollback is linked to its incident."""

from datetime import datetime
from typing import Any

from django.contrib.auth.models import User
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from apps.accounts.permissions import authorize
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.models import Node, NodePool
from apps.incidents.models import Incident
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.rollouts.services import RolloutError, release_rollback, rollout_roll_back

Status = Incident.Status
MANAGE = "incidents.manage_incident"


class IncidentError(Exception):
    """A refused incident change; the message says why."""


def _target(*, incident_id: int = 0, **_: object) -> str:
    return f"incident:{incident_id}" if incident_id else "incident:new"


@audited("incident.open", _target, (IncidentError,))
def incident_open(
    *,
    title: str,
    severity: str,
    start: datetime,
    actor: Actor,
    end: datetime | None = None,
    pool: str = "",
    model: str = "",
    node: str = "",
) -> Incident:
    """A person's incident over a window (from a chart or the timeline); open until resolved."""
    authorize(actor, MANAGE, None)  # incidents are the fleet's, not a pool's
    if not title.strip():
        raise IncidentError("title: say what is wrong, in a few words")
    if severity not in Incident.Severity.values:
        raise IncidentError(f"severity: one of {', '.join(Incident.Severity.values)}")
    if end is not None and end <= start:
        raise IncidentError("start, end: the start comes before the end")
    incident = Incident.objects.create(
        title=title.strip()[:200],
        severity=severity,
        started_at=start,
        opened_by=actor_name(actor),
        **_objects({"pool": pool, "model": model, "node": node}),
    )
    audit_record(
        actor=actor,
        target=f"incident:{incident.pk}",
        after={"title": incident.title, "severity": severity, "start": start.isoformat()},
    )
    return incident


@audited("incident.update", _target, (IncidentError,))
def incident_update(
    *,
    incident_id: int,
    actor: Actor,
    status: str = "",
    owner: str | None = None,
    notes: str | None = None,
) -> Incident:
    """Status (open, mitigated, resolved), owner (a username; "" for nobody) and notes."""
    authorize(actor, MANAGE, None)
    incident = Incident.objects.select_for_update().filter(pk=incident_id).first()
    if incident is None:
        raise IncidentError(f"no incident #{incident_id}")
    before = _facts(incident)
    if status:
        _set_status(incident, status)
    if owner is not None:
        found = User.objects.filter(username=owner).first() if owner else None
        if owner and found is None:
            raise IncidentError(f"owner: no user named {owner!r}")
        incident.owner = found
    if notes is not None:
        incident.notes = notes
    after = _facts(incident)
    if after != before:
        incident.save()
        changed = {k: v for k, v in after.items() if before[k] != v}
        audit_record(
            actor=actor,
            target=f"incident:{incident.pk}",
            before={k: before[k] for k in changed},
            after=changed,
        )
    return incident


def _set_status(incident: Incident, status: str, at: datetime | None = None) -> None:
    if status not in Status.values:
        raise IncidentError(f"status: one of {', '.join(Status.values)}")
    at = at or timezone.now()
    if status != Status.OPEN and incident.mitigated_at is None:
        incident.mitigated_at = at  # resolved implies mitigated
    if status == Status.RESOLVED:
        incident.resolved_at = incident.resolved_at or at
        incident.ended_at = incident.ended_at or at
    else:  # reopened: the window grows again
        incident.resolved_at = incident.ended_at = None
        if status == Status.OPEN:
            incident.mitigated_at = None
    incident.status = status


def _facts(incident: Incident) -> dict[str, str]:
    return {
        "status": incident.status,
        "owner": incident.owner.username if incident.owner else "",
        "notes": incident.notes,
    }


@audited("incident.rollback", _target, (IncidentError,))
def incident_rollback(
    *, incident_id: int, model: str, pool: str, actor: Actor, rollout: int = 0
) -> str:
    """A suspect's one-click rollback, as part of the incident (the rollback's own events are
    parts of this one): a rollout under way is rolled back to the release it started from; any
    other change, the pool goes back to its last good release of the model. Returns what was
    done, in words."""
    authorize(actor, MANAGE, None)
    incident = Incident.objects.filter(pk=incident_id).first()
    if incident is None:
        raise IncidentError(f"no incident #{incident_id}")
    try:
        if Rollout.objects.filter(pk=rollout, state__in=Rollout.ACTIVE).exists():
            why = f"incident #{incident.pk}"
            undone = rollout_roll_back(rollout_id=rollout, actor=actor, reason=why)
            done = f"rollout #{rollout} is rolling back to v{undone.baseline_version}"
        else:
            version = release_rollback(
                model_name=model, pool_name=pool, actor=actor, reason=f"incident #{incident.pk}"
            )
            done = f"pool {pool} is rolling {model} back to v{version}"
    except RolloutError as exc:
        raise IncidentError(str(exc)) from exc
    if incident.status == Status.OPEN:
        Incident.objects.filter(pk=incident.pk).update(
            status=Status.MITIGATED, mitigated_at=timezone.now()
        )
    audit_record(
        actor=actor,
        target=f"incident:{incident.pk}",
        after={"model": model, "pool": pool, "rollout": rollout, "done": done},
    )
    return done


@audited(
    "incident.alert", lambda payload, **_: f"alert:{payload.get('groupKey', '')}", (IncidentError,)
)
def alerts_receive(*, payload: dict[str, Any], actor: Actor) -> Incident | None:
    """Alertmanager's webhook (version 4). One incident per alert group while it is open: a
    repeated notification updates it, a resolved one resolves it. Returns the incident, or None
    for a resolved group that has none open."""
    key = str(payload.get("groupKey") or "")
    if not key:
        raise IncidentError("groupKey: Alertmanager's webhook names the alert group")
    alerts = [a for a in payload.get("alerts") or [] if isinstance(a, dict)]
    labels = payload.get("commonLabels") or {}
    firing = payload.get("status") == "firing"
    authorize(actor, MANAGE, None)
    incident = (
        Incident.objects.select_for_update()
        .filter(alert_key=key)
        .exclude(status=Status.RESOLVED)
        .first()
    )
    if incident is None and not firing:
        return None
    onset = min((t for a in alerts if (t := _moment(a.get("startsAt")))), default=timezone.now())
    if incident is None:
        summary = (payload.get("commonAnnotations") or {}).get("summary", "")
        severity = labels.get("severity", "")
        incident = Incident(
            title=(summary or labels.get("alertname") or "alert")[:200],
            severity=severity if severity in Incident.Severity.values else "warning",
            started_at=onset,
            opened_by=actor_name(actor),
            alert_key=key,
            **_objects({name: labels.get(name, "") for name in ("pool", "model", "node")}),
        )
        action = "incident.open"
    else:
        incident.started_at = min(incident.started_at, onset)
        action = "incident.alert"
    incident.alerts = [
        {k: a.get(k) for k in ("status", "labels", "annotations", "startsAt", "endsAt")}
        for a in alerts
    ]
    if not firing:
        ends = [t for a in alerts if (t := _moment(a.get("endsAt")))]
        _set_status(incident, Status.RESOLVED, max(ends, default=None))
        action = "incident.resolve"
    incident.save()
    audit_record(
        actor=actor,
        action=action,
        target=f"incident:{incident.pk}",
        after={"alert": labels.get("alertname", ""), "status": payload.get("status")},
    )
    return incident


def _objects(names: dict[str, str]) -> dict[str, Any]:
    """The product's pool, model and node an alert's labels (or a form) name, where they exist."""
    found: dict[str, Any] = {}
    for field, manager in (("pool", NodePool), ("model", Model), ("node", Node)):
        if names.get(field):
            found[field] = manager.objects.filter(name=names[field]).first()  # type: ignore[attr-defined]
    return found


def _moment(text: object) -> datetime | None:
    """An Alertmanager time; its zero time (0001-01-01) means none."""
    moment = parse_datetime(text) if isinstance(text, str) else None
    return moment if moment is not None and moment.year > 1 else None

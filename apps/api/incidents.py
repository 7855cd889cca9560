"""Alertmanager's webhook receiver: firing alerts open (or update) an incident per alert group,
resolved ones resolve it. Alertmanager authenticates with an API token of a user allowed to
manage incidents (`http_config: {authorization: {credentials: <token>}}`), best one with the
alerts scope (`manage.py api_token create <user> alertmanager --scope alerts`), refused
everywhere else."""

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema

from apps.accounts.permissions import current_user
from apps.api.auth import can
from apps.api.errors import ERRORS, ApiError
from apps.incidents.services import MANAGE, IncidentError, alerts_receive

router = Router(tags=["incidents"])


class AlertIn(Schema):
    status: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    startsAt: str = ""  # Alertmanager's own field names
    endsAt: str = ""


class AlertmanagerIn(Schema):
    """Alertmanager's webhook body (version 4); fields it sends beyond these are ignored."""

    version: str = "4"
    groupKey: str
    status: str
    receiver: str = ""
    groupLabels: dict[str, str] = {}
    commonLabels: dict[str, str] = {}
    commonAnnotations: dict[str, str] = {}
    alerts: list[AlertIn] = []


class ReceivedOut(Schema):
    incident: int | None  # None: a resolved group with no open incident
    status: str | None
    started_at: datetime | None


@router.post(
    "/alertmanager",
    response={200: ReceivedOut, **ERRORS},
    auth=can(MANAGE, "incident.alert", alerts=True),
)
def alertmanager(request: HttpRequest, body: AlertmanagerIn) -> dict[str, Any]:
    """Idempotent on the group key: Alertmanager repeats a notification until it is taken."""
    try:
        incident = alerts_receive(payload=body.dict(), actor=current_user(request))
    except IncidentError as exc:
        raise ApiError(422, "invalid_request", str(exc)) from exc
    if incident is None:
        return {"incident": None, "status": None, "started_at": None}
    return {"incident": incident.pk, "status": incident.status, "started_at": incident.started_at}

"""Alertmanager's token has a scope of its own: it opens and resolves incidents through
POST /api/alertmanager and is refused (403) everywhere else, so a copy leaked from Alertmanager's
config reads and changes nothing."""

import io
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.utils import timezone

from apps.accounts.models import ApiToken
from apps.accounts.services import token_create
from apps.audit.models import AuditEvent
from apps.incidents.models import Incident

pytestmark = pytest.mark.django_db


def alerts_token(user: User) -> dict[str, str]:
    _, value = token_create(
        user=user, name="alertmanager", actor="system:test", scope=ApiToken.Scope.ALERTS
    )
    return {"Authorization": f"Bearer {value}"}


def group(status: str) -> dict:
    starts = (timezone.now() - timedelta(minutes=2)).isoformat()
    labels = {"alertname": "ControlPlaneBrokerDown", "severity": "critical"}
    return {
        "version": "4",
        "groupKey": '{}:{alertname="ControlPlaneBrokerDown"}',
        "status": status,
        "commonLabels": labels,
        "commonAnnotations": {"summary": "The broker does not answer"},
        "alerts": [{"status": status, "labels": labels, "startsAt": starts}],
    }


def test_an_alerts_token_opens_and_resolves_incidents(client: Client, operator: User) -> None:
    headers = alerts_token(operator)
    for status in ("firing", "resolved"):
        response = client.post(
            "/api/alertmanager", group(status), content_type="application/json", headers=headers
        )
        assert response.status_code == 200, response.content
    assert Incident.objects.get().status == "resolved"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("get", "/api/nodes"),
        ("get", "/api/rollouts"),
        ("get", "/api/audit"),
        ("post", "/api/deployments"),
        ("post", "/api/nodes/demo-1/operations"),
        ("get", "/api/docs"),
        ("get", "/api/openapi.json"),
        ("get", "/metrics"),
    ],
)
def test_an_alerts_token_is_refused_everywhere_else(
    client: Client, operator: User, method: str, path: str
) -> None:
    response = getattr(client, method)(path, {}, headers=alerts_token(operator))
    assert response.status_code == 403, response.content
    assert b"only send alerts" in response.content


def test_a_refused_alerts_token_is_audited(client: Client, operator: User) -> None:
    client.get("/api/nodes", headers=alerts_token(operator))
    event = AuditEvent.objects.get(result=AuditEvent.Result.DENIED)
    assert (event.action, event.target) == ("api.read", "/api/nodes")
    assert "alerts only" in event.message


def test_an_alerts_token_still_needs_a_user_who_may_manage_incidents(
    client: Client, viewer: User
) -> None:
    response = client.post(
        "/api/alertmanager",
        group("firing"),
        content_type="application/json",
        headers=alerts_token(viewer),
    )
    assert response.status_code == 403
    assert not Incident.objects.exists()


def test_the_api_token_command_creates_an_alerts_token(operator: User) -> None:
    out = io.StringIO()
    call_command(
        "api_token", "create", operator.username, "alertmanager", "--scope", "alerts", stdout=out
    )
    assert ApiToken.objects.get(name="alertmanager").scope == ApiToken.Scope.ALERTS
    assert out.getvalue().split()[-1].startswith("tcp_")
    call_command("api_token", "create", operator.username, "grafana", "--read-only", stdout=out)
    assert ApiToken.objects.get(name="grafana").scope == ApiToken.Scope.READ
    call_command("api_token", "create", operator.username, "ci", stdout=out)
    assert ApiToken.objects.get(name="ci").scope == ApiToken.Scope.WRITE
    with pytest.raises(CommandError):
        call_command(
            "api_token", "create", operator.username, "x", "--scope", "everything", stdout=out
        )

"""JSON log lines carry the request id that the response and the audit trail carry."""

import io
import json
import logging
import logging.config
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db.models.signals import post_save
from django.test import Client

from apps.accounts.models import ApiToken
from apps.accounts.services import token_create
from apps.audit.context import HEADER, REQUEST_ID
from apps.audit.models import AuditEvent
from controlplane.logs import JsonFormatter, logging_config

log = logging.getLogger("tests.logs")


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """What the root logger writes through the JSON formatter, as logging_config sets it up."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


def entries(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_line_has_time_level_logger_message_and_request_id(lines: io.StringIO) -> None:
    token = REQUEST_ID.set("req-1")
    try:
        log.warning("node %s: %s", "gpu-1", "refused")
    finally:
        REQUEST_ID.reset(token)
    log.warning("outside any request")
    first, second = entries(lines)
    assert first.keys() == {"time", "level", "logger", "message", "request_id"}
    assert first["time"].endswith("+00:00")
    assert (first["level"], first["logger"]) == ("WARNING", "tests.logs")
    assert (first["message"], first["request_id"]) == ("node gpu-1: refused", "req-1")
    assert second["request_id"] == ""


@pytest.mark.django_db
def test_a_line_logged_in_a_request_names_its_response_and_its_audit_event(
    client: Client, viewer: User, lines: io.StringIO
) -> None:
    _, value = token_create(user=viewer, name="ci", actor="system:test", scope=ApiToken.Scope.READ)

    def note(instance: AuditEvent, **_: object) -> None:
        log.info("audit %s %s", instance.action, instance.result)

    post_save.connect(note, sender=AuditEvent, weak=False)
    try:
        # A read-only token refused a write: the API records the refusal as an audit event.
        response = client.post(
            "/api/deployments",
            "{}",
            content_type="application/json",
            headers={"Authorization": f"Bearer {value}"},
        )
    finally:
        post_save.disconnect(note, sender=AuditEvent)
    assert response.status_code == 403
    event = AuditEvent.objects.get(result=AuditEvent.Result.DENIED)
    (line,) = (e for e in entries(lines) if e["message"].startswith("audit "))
    assert line["request_id"] == response[HEADER] == event.request_id != ""
    # Django's own "Forbidden: /api/deployments", written after the middleware returned.
    (django_line,) = (e for e in entries(lines) if e["logger"] == "django.request")
    assert django_line["request_id"] == response[HEADER]


@pytest.mark.django_db
def test_an_error_in_a_view_logs_its_traceback_as_one_json_line(
    monkeypatch: pytest.MonkeyPatch, lines: io.StringIO
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr("controlplane.health.HttpResponse", broken)
    response = Client(raise_request_exception=False).get("/healthz")
    assert response.status_code == 500
    (line,) = (e for e in entries(lines) if e["logger"] == "django.request")
    assert line["level"] == "ERROR"
    assert line["request_id"] == response[HEADER]
    assert line["exception"].startswith("Traceback (most recent call last):")
    assert line["exception"].endswith("RuntimeError: boom")


def test_gunicorn_access_lines_take_the_id_from_the_response_header() -> None:
    # gunicorn writes its access line after the response left Django's middleware; what its
    # Logger.access passes: its format string and a dict of "atoms", response headers included.
    atoms = {"h": "10.0.0.1", "r": "GET /metrics HTTP/1.1", "{x-request-id}o": "abc123"}
    record = logging.getLogger("gunicorn.access").makeRecord(
        "gunicorn.access", logging.INFO, __file__, 1, "%(h)s %(r)s", (atoms,), None
    )
    line = json.loads(JsonFormatter().format(record))
    assert (line["message"], line["request_id"]) == ("10.0.0.1 GET /metrics HTTP/1.1", "abc123")


def test_logging_config_sends_root_django_and_gunicorn_loggers_through_json() -> None:
    config = logging_config("DEBUG")
    assert config["root"] == {"handlers": ["json"], "level": "DEBUG"}
    assert config["formatters"]["json"]["()"] is JsonFormatter
    for name in ["gunicorn.error", "gunicorn.access", "celery.task"]:
        assert config["loggers"][name] == {"handlers": ["json"], "propagate": False}
    # No handler of its own: Django's DEBUG-only console handler would write each line twice.
    assert config["loggers"]["django"]["handlers"] == []
    formatter = logging.config.DictConfigurator(config).configure_formatter(
        config["formatters"]["json"]
    )
    assert isinstance(formatter, JsonFormatter)

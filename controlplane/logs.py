"""Structured logs: one JSON object a line, carrying the request id the audit trail records, so a
log line, the response a user quotes (X-Request-ID) and the audit events of one request (or of the
tasks it enqueued) are found by the same id."""

import json
import logging
from datetime import UTC, datetime
from typing import Any

from apps.audit.context import HEADER, META_KEY, REQUEST_ID

# gunicorn's access line is written after the response has left Django's middleware, so the id
# is no longer in context there; the response header it logs alongside still names it.
_ACCESS_ATOM = "{" + HEADER.lower() + "}o"  # gunicorn's name for a response header


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": REQUEST_ID.get() or _late_request_id(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str)


def _late_request_id(record: logging.LogRecord) -> str:
    """The id of a line written after the request's context ended: Django's 4xx lines carry the
    request, gunicorn's access lines the response header."""
    request = getattr(record, "request", None)
    if request is not None and hasattr(request, "META"):
        return str(request.META.get(META_KEY, ""))
    if record.name == "gunicorn.access" and isinstance(record.args, dict):
        found = record.args.get(_ACCESS_ATOM)
        return found if isinstance(found, str) else ""
    return ""


def logging_config(level: str) -> dict[str, Any]:
    """settings.LOGGING: everything as JSON on stderr. gunicorn's loggers are taken over in its
    workers (which load Django), Celery's task loggers where the worker leaves the root logger
    alone (CELERY_WORKER_HIJACK_ROOT_LOGGER = False), and Django's DEBUG-only console handler is
    dropped so that no line is written twice."""
    json_only = {"handlers": ["json"], "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["json"], "level": level},
        "loggers": {
            "django": {"handlers": [], "propagate": True},
            "django.server": json_only,
            "gunicorn.error": json_only,
            "gunicorn.access": json_only,
            "celery.task": json_only,
            # django-axes notes every successful sign-in at INFO; its warnings (lockouts) stay.
            "axes": {"level": "WARNING"},
        },
    }

"""Which request (or the task it enqueued) an audit event was written for."""

import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar, copy_context
from typing import Any

from django.http import HttpRequest, HttpResponse

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="")
# How the actor acted when it was not through the pages: "API token ci (tcp_Ab12Cd…)".
VIA: ContextVar[str] = ContextVar("via", default="")
HEADER = "X-Request-ID"
META_KEY = "controlplane.request_id"
# What a proxy may hand us: anything longer or stranger is replaced, never stored.
_SANE = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id_for(given: str) -> str:
    return given if _SANE.fullmatch(given) else uuid.uuid4().hex


class RequestIdMiddleware:
    """Every request gets an id: the proxy's X-Request-ID when it is sane, a new one otherwise.
    Events written while it is handled carry it, so do the tasks it enqueues (controlplane.celery),
    and the response names it, so a user can quote it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        request_id = request_id_for(request.headers.get(HEADER, ""))
        # A context of its own: what the request sets (its id, the token it used) ends with it.
        response = copy_context().run(self._handle, request, request_id)
        response[HEADER] = request_id
        return response

    def _handle(self, request: HttpRequest, request_id: str) -> HttpResponse:
        REQUEST_ID.set(request_id)
        # Django logs a 4xx after the middleware returned, with the request: the id goes along.
        request.META[META_KEY] = request_id
        return self.get_response(request)


def carry_request_id(headers: dict[str, Any], **_: object) -> None:
    """Celery `before_task_publish`: the task goes out with the id it was enqueued under."""
    if REQUEST_ID.get():
        headers.setdefault("request_id", REQUEST_ID.get())


def adopt_request_id(task: Any, **_: object) -> None:
    """Celery `task_prerun`: the task's own events (and the tasks it enqueues) carry that id."""
    REQUEST_ID.set(getattr(task.request, "request_id", None) or "")

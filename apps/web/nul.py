"""PostgreSQL text cannot hold NUL (0x00): a query that carries one fails in the database, which
would be a 500. Such input is refused at the door, with the reason: here for the pages, and by
the API's authentication for the API (after the permission check, so that a viewer's change is
refused as forbidden whatever it sends)."""

import json
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest

MESSAGE = "NUL characters (0x00) are not allowed in {where}"


class RejectNulMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        where = "" if request.path.startswith("/api/") else nul_in(request)
        if not where:
            return self.get_response(request)
        message = MESSAGE.format(where=where)
        return HttpResponseBadRequest(message, content_type="text/plain; charset=utf-8")


def nul_in(request: HttpRequest) -> str:
    """Where the request carries a NUL character, or "" when it does not."""
    if "\x00" in request.path:
        return "the path"
    if any("\x00" in key + value for key, values in request.GET.lists() for value in values):
        return "the query string"
    if request.content_type == "application/json" and b"\\u0000" in request.body:
        try:  # only escaped can a JSON string carry NUL: look closer only then
            if _holds_nul(json.loads(request.body)):
                return "the JSON body"
        except ValueError:
            pass  # not JSON: the view says so
    form = request.content_type == "application/x-www-form-urlencoded"
    if form and any("\x00" in key + "".join(vs) for key, vs in request.POST.lists()):
        return "the form"
    return ""


def _holds_nul(value: object) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(_holds_nul(k) or _holds_nul(v) for k, v in value.items())
    return isinstance(value, list) and any(_holds_nul(v) for v in value)

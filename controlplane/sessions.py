"""A session ends after SESSION_COOKIE_AGE without a request, every request starting the count
again; but it is written at most once a SESSION_TOUCH_S. Saving it on every request (Django's
SESSION_SAVE_EVERY_REQUEST) wrote a row for each poll of every open page, 30 a minute for the
live parts that refresh every 2 s, and cost the chart endpoint a write."""

import time
from collections.abc import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

TOUCHED = "_touched"


class IdleSessionMiddleware:
    """After the session middleware: a signed-in session not written for SESSION_TOUCH_S is
    marked changed, so that it is saved with a new expiry."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        session = request.session
        now = int(time.time())
        if session.session_key and now - session.get(TOUCHED, 0) >= settings.SESSION_TOUCH_S:
            session[TOUCHED] = now
        return self.get_response(request)

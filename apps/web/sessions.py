"""A session ends after SESSION_COOKIE_AGE without a request from the person, and
SESSION_MAX_AGE_S after sign-in however active they are; it is written at most once a
SESSION_TOUCH_S. Saving it on every request (Django's SESSION_SAVE_EVERY_REQUEST) wrote a row for
each poll of every open page, 30 a minute for the live parts that refresh every 2 s, and cost the
chart endpoint a write.

A live part's poll is not the person: a page left open would otherwise keep its session alive
for ever. static/app.js marks the requests of every element polling with `hx-trigger="every …"`
with the POLL_HEADER; those neither start the idle count again nor escape either limit."""

import time
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.contrib.auth import SESSION_KEY
from django.http import HttpRequest, HttpResponse

TOUCHED = "_touched"
STARTED = "_started"
POLL_HEADER = "X-Poll"


def is_poll(request: HttpRequest) -> bool:
    return "HX-Request" in request.headers and POLL_HEADER in request.headers


def session_started(sender: object, request: HttpRequest, **_: Any) -> None:
    """On sign-in (django.contrib.auth's user_logged_in): the absolute lifetime starts. Set
    here, not on the next request: django.contrib.auth keeps the data of the session a person
    had before signing in, and its start must not count."""
    request.session[STARTED] = int(time.time())


class IdleSessionMiddleware:
    """After the session middleware, before authentication: a signed-in session past either
    limit is ended here (so the request is anonymous and the sign-in page follows); one not
    written for SESSION_TOUCH_S by a person's request is marked changed, so that it is saved
    with a new expiry."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        session = request.session
        if session.session_key and SESSION_KEY in session:
            now = int(time.time())
            started, touched = session.get(STARTED), session.get(TOUCHED, 0)
            # The session's own expiry alone would not do: anything else that writes it during
            # a poll (a message, say) would move that expiry on.
            if (started is not None and now - started >= settings.SESSION_MAX_AGE_S) or (
                touched and now - touched >= settings.SESSION_COOKIE_AGE
            ):
                session.flush()
            elif started is None:  # signed in before the lifetime was recorded: from now
                session[STARTED] = session[TOUCHED] = now
            elif not is_poll(request) and now - touched >= settings.SESSION_TOUCH_S:
                session[TOUCHED] = now
        return self.get_response(request)

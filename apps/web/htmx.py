from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.utils.html import format_html
from django_htmx.http import HttpResponseClientRedirect
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    """The request type of views that answer htmx with a fragment (HtmxMiddleware sets `.htmx`)."""

    htmx: HtmxDetails


def back(request: HttpRequest, url: str) -> HttpResponse:
    """After a POST: htmx (which asked for the confirmation) navigates, a plain form redirects."""
    if getattr(request, "htmx", False):
        return HttpResponseClientRedirect(url)
    return redirect(url)


def refused(request: HttpRequest, message: str, url: str, status: int = 409) -> HttpResponse:
    """A refused POST: htmx gets the message with its status, and the page says it where the
    person clicked (static/app.js); a plain form goes back to `url`, which shows it."""
    if getattr(request, "htmx", False):
        return HttpResponse(format_html('<p class="flash error">{}</p>', message), status=status)
    messages.error(request, message)
    return redirect(url)

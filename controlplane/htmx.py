from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
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

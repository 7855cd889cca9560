from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails


class HtmxHttpRequest(HttpRequest):
    """The request type of views that answer htmx with a fragment (HtmxMiddleware sets `.htmx`)."""

    htmx: HtmxDetails

from collections.abc import Callable

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.urls import reverse

from apps.accounts.permissions import ApprovalRequired, current_user
from apps.approvals.services import approval_request
from apps.web.htmx import back


class ApprovalMiddleware:
    """A page's change that a protected pool refused becomes a request for approval, and the
    person is sent to the approvals page, which says so."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exc: Exception) -> HttpResponse | None:
        if not isinstance(exc, ApprovalRequired) or request.path.startswith("/api/"):
            return None
        approval = approval_request(refused=exc, actor=current_user(request))
        messages.info(
            request,
            f"Pool {approval.pool.name} is protected: {approval.action} is request "
            f"#{approval.pk}, waiting for a second person until "
            f"{approval.expires_at:%H:%M} UTC.",
        )
        return back(request, reverse("approvals:list"))

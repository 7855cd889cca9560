from collections.abc import Callable
from urllib.parse import urlencode

from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.approvals.models import Approval
from apps.approvals.services import (
    APPROVER_PERMISSION,
    ApprovalError,
    approval_approve,
    approval_reject,
    approval_withdraw,
)
from apps.fleet.models import NodePool
from apps.web.guard import takes_post
from apps.web.htmx import back, refused


def approval_list(request: HttpRequest) -> HttpResponse:
    """Changes to protected pools waiting for a second person, then the ones decided; filtered
    by state and pool."""
    status, pool = request.GET.get("status", ""), request.GET.get("pool", "")
    found = Approval.objects.select_related("pool", "requested_by", "approved_by", "rejected_by")
    if status:
        found = found.filter(status=status)
    if pool:
        found = found.filter(pool__name=pool)
    page = Paginator(found, 25).get_page(request.GET.get("page"))
    context = {
        "page": page,
        "now": timezone.now(),
        "user_id": current_user(request).pk,
        "status": status,
        "pool": pool,
        "statuses": Approval.Status.choices,
        "pools": NodePool.objects.filter(protected=True).values_list("name", flat=True),
        "query": urlencode({k: v for k, v in (("status", status), ("pool", pool)) if v}),
    }
    return render(request, "approvals/approvals.html", context)


@require_POST
@require(APPROVER_PERMISSION, "approval.approve")
def approval_approve_view(request: HttpRequest, pk: int) -> HttpResponse:
    here = reverse("approvals:list")
    try:
        approval = approval_approve(approval_id=pk, actor=current_user(request))
    except ApprovalError as exc:
        return refused(request, str(exc), here)
    done = f"Approved #{pk}: {approval.action} on {approval.pool.name} is {approval.status}"
    (messages.success if not approval.result else messages.error)(
        request, done + (f": {approval.result}" if approval.result else ".")
    )
    return back(request, here)


@require_POST
@require(APPROVER_PERMISSION, "approval.reject")
def approval_reject_view(request: HttpRequest, pk: int) -> HttpResponse:
    return _close(request, pk, approval_reject, f"Rejected #{pk}: its requester sees why.")


@takes_post
@require_POST
def approval_withdraw_view(request: HttpRequest, pk: int) -> HttpResponse:
    """One's own request taken back: the service refuses anyone but its requester."""
    return _close(request, pk, approval_withdraw, f"Withdrew #{pk}: no one can approve it now.")


def _close(
    request: HttpRequest, pk: int, service: Callable[..., Approval], done: str
) -> HttpResponse:
    """A request rejected or withdrawn, with the form's reason; the page says how it went."""
    here = reverse("approvals:list")
    try:
        service(approval_id=pk, reason=request.POST.get("reason", ""), actor=current_user(request))
    except ApprovalError as exc:
        return refused(request, str(exc), here)
    messages.success(request, done)
    return back(request, here)

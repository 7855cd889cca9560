from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.permissions import current_user, require
from apps.approvals.models import Approval
from apps.approvals.services import APPROVER_PERMISSION, ApprovalError, approval_approve
from controlplane.htmx import back


def approval_list(request: HttpRequest) -> HttpResponse:
    """Changes to protected pools waiting for a second person, then the ones decided."""
    found = Approval.objects.select_related("pool", "requested_by", "approved_by")
    page = Paginator(found, 25).get_page(request.GET.get("page"))
    context = {"page": page, "now": timezone.now(), "user_id": current_user(request).pk}
    return render(request, "approvals/approvals.html", context)


@require_POST
@require(APPROVER_PERMISSION, "approval.approve")
def approval_approve_view(request: HttpRequest, pk: int) -> HttpResponse:
    try:
        approval = approval_approve(approval_id=pk, actor=current_user(request))
    except ApprovalError as exc:
        messages.error(request, str(exc))
    else:
        done = f"Approved #{pk}: {approval.action} on {approval.pool.name} is {approval.status}"
        (messages.success if not approval.result else messages.error)(
            request, done + (f": {approval.result}" if approval.result else ".")
        )
    return back(request, reverse("approvals:list"))

"""Changes to protected pools waiting for a second person, and their approval."""

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, ApiError
from apps.api.paging import Limit, Offset
from apps.approvals.models import Approval
from apps.approvals.services import (
    APPROVER_PERMISSION,
    ApprovalError,
    approval_approve,
    approval_reject,
    approval_withdraw,
)

router = Router(tags=["rollouts"], auth=Token())


class ApprovalOut(Schema):
    id: int
    pool: str
    action: str
    params: dict[str, Any]
    # What it was asked against: the release the pool ran, a rollout's state, and the evaluation
    # sets a rollout's gates will run, each described as it was then.
    resolved: dict[str, Any]
    requested_by: str
    requested_at: datetime
    expires_at: datetime
    status: str
    approved_by: str | None
    result: str
    rejected_by: str | None
    reason: str  # a rejection's, or a withdrawal's if one was given


def _approval_out(approval: Approval) -> dict[str, Any]:
    return {
        "id": approval.pk,
        "pool": approval.pool.name,
        "action": approval.action,
        "params": approval.params,
        "resolved": approval.resolved,
        "requested_by": approval.requested_by.username,
        "requested_at": approval.requested_at,
        "expires_at": approval.expires_at,
        "status": approval.status,
        "approved_by": approval.approved_by.username if approval.approved_by else None,
        "result": approval.result,
        "rejected_by": approval.rejected_by.username if approval.rejected_by else None,
        "reason": approval.reason,
    }


@router.get("/approvals", response={200: list[ApprovalOut], **ERRORS})
def list_approvals(
    request: HttpRequest, offset: int = Offset, limit: int = Limit
) -> list[dict[str, Any]]:
    """Changes to protected pools, newest first: a change there answers 202 with its approval,
    which waits for a second person (POST /approvals/{id}/approve) until `expires_at`."""
    found = Approval.objects.select_related("pool", "requested_by", "approved_by", "rejected_by")
    return [_approval_out(a) for a in found[offset : offset + limit]]


@router.post(
    "/approvals/{approval_id}/approve",
    response={200: ApprovalOut, **ERRORS},
    auth=can(APPROVER_PERMISSION, "approval.approve"),
)
def approve(request: HttpRequest, approval_id: int) -> dict[str, Any]:
    """Carry out someone else's pending change now, as theirs: `status` says whether it went
    through (approved) or the change itself was refused (failed, with `result`)."""
    try:
        approval = approval_approve(approval_id=approval_id, actor=current_user(request))
    except ApprovalError as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    return _approval_out(approval)


class Decision(Schema):
    reason: str = ""


@router.post(
    "/approvals/{approval_id}/reject",
    response={200: ApprovalOut, **ERRORS},
    auth=can(APPROVER_PERMISSION, "approval.reject"),
)
def reject(request: HttpRequest, approval_id: int, body: Decision) -> dict[str, Any]:
    """Refuse someone else's pending change, with a `reason` (required) its requester reads."""
    try:
        approval = approval_reject(
            approval_id=approval_id, reason=body.reason, actor=current_user(request)
        )
    except ApprovalError as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    return _approval_out(approval)


@router.post(
    "/approvals/{approval_id}/withdraw",
    response={200: ApprovalOut, **ERRORS},
    auth=can("fleet.operate_node", "approval.withdraw"),  # whoever may ask for a change
)
def withdraw(request: HttpRequest, approval_id: int, body: Decision) -> dict[str, Any]:
    """Take back one's own pending change, with a `reason` if one is given: no one can approve
    it any more (only whoever asked may)."""
    try:
        approval = approval_withdraw(
            approval_id=approval_id, reason=body.reason, actor=current_user(request)
        )
    except ApprovalError as exc:
        raise ApiError(409, "conflict", str(exc)) from None
    return _approval_out(approval)

"""Each pool's desired state as files, for CI: what differs from the database, and the
database made to match them (as `manage.py desired diff|apply`)."""

from typing import Any

from django.http import HttpRequest
from ninja import Router, Schema

from apps.accounts.permissions import current_user
from apps.api.auth import Token, can
from apps.api.errors import ERRORS, ApiError
from apps.statefiles.files import FilesError
from apps.statefiles.services import desired_apply, plan

router = Router(tags=["desired state"], auth=Token())


class FilesIn(Schema):
    files: dict[str, str]  # a pool's file name (demo.yaml): its text


class ApplyIn(FilesIn):
    commit: str  # the files' commit, on the audit trail


class DiffOut(Schema):
    differences: list[str]


class AppliedOut(Schema):
    changes: list[str]
    waiting: list[int]  # approvals a second person must give on protected pools


def _refused(exc: FilesError) -> ApiError:
    details = [
        {"file": p.file, "line": p.line or None, "field": p.field, "message": p.message}
        for p in exc.problems
    ]
    return ApiError(422, "invalid_files", str(exc), details)


@router.post("/desired/validate", response={200: DiffOut, **ERRORS})
def validate(request: HttpRequest, body: FilesIn) -> dict[str, Any]:
    """The files checked, and what applying them would change (`desired diff`), one line
    each; pools in no file are named. Changes nothing."""
    try:
        return {"differences": plan(body.files).differences()}
    except FilesError as exc:
        raise _refused(exc) from None


@router.post(
    "/desired/apply",
    response={200: AppliedOut, **ERRORS},
    auth=can("rollouts.add_rollout", "desired.apply"),
)
def apply(request: HttpRequest, body: ApplyIn) -> dict[str, Any]:
    """Make the database match the files, all or nothing, as one audited change naming
    `commit`; on a protected pool a change waits for a second person (its approval listed)."""
    try:
        applied = desired_apply(files=body.files, commit=body.commit, actor=current_user(request))
    except FilesError as exc:
        raise _refused(exc) from None
    return {"changes": applied.changes, "waiting": applied.waiting}

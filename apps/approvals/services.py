"""Two people for a protected pool: a person's deployment, rollout start or retry, promotion,
degradation tiers, opening to discovery, scaling bounds, override of a refused load or adoption
there is refused by its service with ApprovalRequired (a move back never is:
apps.accounts.permissions.moving_back); it becomes a request that someone else with a release
manager's role on the pool approves before it expires, which carries it out as the
requester's, with the approver named in the trail."""

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.db.models.functions import Now
from django.utils import timezone

from apps.accounts.permissions import APPROVING, ApprovalRequired, authorize
from apps.approvals.models import Approval
from apps.audit.services import audit_record, audited
from apps.degradation.services import TierError, tiers_set
from apps.fleet.errors import FleetError
from apps.fleet.models import Deployment, Node, NodePool, Operation
from apps.fleet.services.deployments import deployment_remove, deployment_set
from apps.fleet.services.nodes import node_adopt, operation_override
from apps.fleet.services.pools import pool_set_discoverable
from apps.observability.bottleneck import Advice
from apps.quality.models import EvaluationSet
from apps.rollouts.models import Rollout
from apps.rollouts.notify import notify_approval
from apps.rollouts.plans import PlanError
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import RolloutError, rollout_promote, rollout_retry
from apps.rollouts.tuning import tuning_start
from apps.scaling.services import scaling_set
from apps.web.clock import database_now

APPROVER_PERMISSION = "rollouts.change_rollout"  # a release manager's, on the pool


def _deploy(params: dict[str, Any], actor: User) -> object:
    where: dict[str, Any] = (
        {"pool": NodePool.objects.get(name=params["pool"])}
        if "pool" in params
        else {"node": Node.objects.get(name=params["node"])}
    )
    return deployment_set(
        model_name=params["model"],
        version=params["version"],
        baseline=params.get("baseline"),
        standby=params.get("standby"),
        actor=actor,
        **where,
    )


ACTIONS: dict[str, Callable[[dict[str, Any], User], object]] = {
    "deployment.set": _deploy,
    "deployment.remove": lambda p, actor: deployment_remove(
        deployment_id=p["deployment_id"], actor=actor
    ),
    "rollout.promote": lambda p, actor: rollout_promote(
        rollout_id=p["rollout_id"], reason=p["reason"], actor=actor
    ),
    "rollout.start": lambda p, actor: rollout_start(
        model_name=p["model"],
        pool_name=p["pool"],
        canary_version=p["canary"],
        plan=p["plan"],
        analysis=p["analysis"],  # whole, as resolved when asked: the template adds nothing
        template=p["template"],
        lockstep=[(m["model"], m["canary"]) for m in p["lockstep"]],
        accept_shares=p["accept_shares"],
        strategy=p.get("strategy", "canary"),  # requests from before it had one
        template_version=p.get("template_version"),  # ... and before what it runs was pinned
        quality_sets=p.get("quality_sets"),
        actor=actor,
    ),
    "rollout.retry": lambda p, actor: rollout_retry(rollout_id=p["rollout_id"], actor=actor),
    "rollout.tune": lambda p, actor: tuning_start(
        pipeline=p["pipeline"],
        pool_name=p["pool"],
        advice=Advice(**p["advice"]),
        plan=p["plan"],
        template=p["template"],
        analysis=p["analysis"],
        actor=actor,
    ),
    "operation.override": lambda p, actor: operation_override(
        operation_id=p["operation_id"], reason=p["reason"], actor=actor
    ),
    "pool.set_tiers": lambda p, actor: tiers_set(
        pool_name=p["pool"], model_name=p["model"], versions=p["versions"], actor=actor
    ),
    "pool.set_discoverable": lambda p, actor: pool_set_discoverable(
        pool_name=p["pool"], discoverable=p["discoverable"], actor=actor
    ),
    "pool.set_scaling": lambda p, actor: scaling_set(
        pool_name=p["pool"], least=p["least"], most=p["most"], actor=actor
    ),
    "node.adopt": lambda p, actor: node_adopt(
        node_id=Node.objects.get(name=p["node"]).pk, model_name=p["model"], actor=actor
    ),
}


def _resolved(pool: NodePool, params: dict[str, Any]) -> dict[str, Any]:
    """What a change is resolved against: the release of its model (or pipeline) that the pool
    (or its node) runs now; where it acts on a rollout, that rollout's state and step; for an
    override, the newest operation planned for its node and model; for an adoption, the
    versions the node's last index shows; for a removal, the deployment's version; for opening
    to discovery, whether the pool is open."""
    found: dict[str, Any] = {}
    if "rollout_id" in params:
        rollout = Rollout.objects.filter(pk=params["rollout_id"]).values("state", "step").first()
        found["rollout"] = f"{rollout['state']} at step {rollout['step'] + 1}" if rollout else None
    if "operation_id" in params:
        refused = Operation.objects.filter(pk=params["operation_id"])
        same = refused.values("node", "model_name").first() or {"pk": params["operation_id"]}
        newest = Operation.objects.filter(**same).order_by("-pk")
        found["planned"] = newest.values_list("pk", flat=True).first()
    if "deployment_id" in params:
        removed = Deployment.objects.filter(pk=params["deployment_id"])
        found["deployment"] = removed.values_list("version", flat=True).first()
    if "discoverable" in params:
        open_now = NodePool.objects.filter(pk=pool.pk).values_list("discoverable", flat=True)
        found["discoverable"] = open_now.first()
    if sets := params.get("quality_sets"):
        found["sets"] = _sets(sets)
    model = params.get("model") or params.get("pipeline")
    if model and "node" in params and "operation_id" not in params:
        index = Node.objects.filter(name=params["node"]).values_list("index", flat=True).first()
        found["loaded"] = sorted(e["version"] for e in index or [] if e["model"] == model)
    if model:
        where = {"node__name": params["node"]} if "node" in params else {"pool": pool}
        serving = Deployment.objects.filter(model__name=model, **where)
        found["release"] = serving.values_list("version", flat=True).first()
    return found


def _sets(pinned: dict[str, int]) -> dict[str, str]:
    """The evaluation sets a rollout's gates will run, as its approver must see them: a set
    imported just before by the requester, say, is named as theirs."""
    found = EvaluationSet.objects.filter(pk__in=pinned.values()).annotate(size=Count("cases"))
    by_pk = {s.pk: s for s in found}
    return {
        model: f"{s.name} v{s.version}, {s.size} cases, imported by {s.created_by} "
        f"at {s.created_at:%Y-%m-%d %H:%M} UTC"
        if (s := by_pk.get(pk))
        else f"#{pk}, gone"
        for model, pk in pinned.items()
    }


def _stale(approval: Approval, now: dict[str, Any]) -> str:
    """Why what an approval was asked against no longer holds ("" when it does)."""
    asked, params = approval.resolved, approval.params
    model = params.get("model") or params.get("pipeline")
    if asked.get("release") != now.get("release"):
        return f"{model} moved from v{asked.get('release')} to v{now.get('release')}"
    if asked.get("rollout") != now.get("rollout"):
        rollout = params["rollout_id"]
        return f"rollout #{rollout} was {asked.get('rollout')}, is {now.get('rollout')}"
    if asked.get("deployment") != now.get("deployment"):
        was, is_now = (
            f"v{v}" if v else "gone" for v in (asked.get("deployment"), now.get("deployment"))
        )
        return f"deployment #{params['deployment_id']} was {was}, is {is_now}"
    if asked.get("discoverable") != now.get("discoverable"):
        state = "open to discovery" if now.get("discoverable") else "closed to discovery"
        return f"pool {approval.pool.name} is {state} now, by someone else"
    if asked.get("planned") != now.get("planned"):
        return f"{params['node']} was planned again (operation #{now.get('planned')})"
    if asked.get("loaded") != now.get("loaded"):
        shown = {
            key: ", ".join(f"v{v}" for v in found.get("loaded") or []) or "nothing"
            for key, found in (("asked", asked), ("now", now))
        }
        return f"{model} on {params['node']} was {shown['asked']}, is {shown['now']}"
    return ""


class ApprovalError(Exception):
    pass


@audited("approval.request", lambda refused, **_: f"pool:{refused.pool.name}")
def approval_request(*, refused: ApprovalRequired, actor: User) -> Approval:
    """The refused change, kept to be approved (the same request again returns the first)."""
    pending = Approval.objects.filter(
        pool=refused.pool,
        action=refused.action,
        params=refused.params,
        requested_by=actor,
        status=Approval.Status.PENDING,
        expires_at__gt=Now(),
    ).first()
    if pending is not None:
        return pending
    approval = Approval.objects.create(
        pool=refused.pool,
        action=refused.action,
        params=refused.params,
        resolved=_resolved(refused.pool, refused.params),
        requested_by=actor,
        expires_at=database_now() + timedelta(seconds=settings.APPROVAL_TTL_S),
    )
    audit_record(
        actor=actor,
        target=f"pool:{refused.pool.name}",
        after={"approval": approval.pk, "action": refused.action, "params": refused.params},
    )
    notify_approval(
        approval_id=approval.pk,
        pool=refused.pool.name,
        event="approval_pending",
        what=f"{refused.action} ({approval.summary}) asked by {actor.username} waits for a "
        f"second person until {approval.expires_at:%H:%M} UTC",
    )
    return approval


def _approval_target(*, approval_id: int, **_: object) -> str:
    return f"approval:{approval_id}"


def _pending(approval_id: int) -> Approval:
    """The approval, locked, while it still waits for a decision."""
    approval = (
        Approval.objects.select_for_update()
        .select_related("pool", "requested_by")
        .filter(pk=approval_id)
        .first()
    )
    if approval is None:
        raise ApprovalError(f"there is no approval #{approval_id}")
    if approval.status != Approval.Status.PENDING:
        raise ApprovalError(f"approval #{approval_id} is {approval.status} already")
    if approval.expires_at <= database_now():
        raise ApprovalError(
            f"approval #{approval_id} expired at {approval.expires_at:%H:%M:%S} UTC"
        )
    return approval


@audited("approval.approve", _approval_target, (ApprovalError,))
def approval_approve(*, approval_id: int, actor: User) -> Approval:
    """Carry out a pending request of someone else's, as theirs, now."""
    approval = _pending(approval_id)
    if approval.requested_by_id == actor.pk:
        raise ApprovalError("a change needs a second person: you cannot approve your own")
    authorize(actor, APPROVER_PERMISSION, approval.pool)
    approval.approved_by, approval.approved_at = actor, timezone.now()
    token = APPROVING.set(approval.pk)
    now = _resolved(approval.pool, approval.params)
    try:
        if approval.resolved and (stale := _stale(approval, now)):
            raise ApprovalError(f"{stale} since it was asked: ask again")
        if approval.action not in ACTIONS:  # asked before moves back stopped waiting
            raise ApprovalError(f"{approval.action} needs no approval now: do it yourself")
        ACTIONS[approval.action](approval.params, approval.requested_by)
        approval.status = Approval.Status.APPROVED
    except (FleetError, RolloutError, PlanError, TierError, ApprovalError) as exc:
        approval.status, approval.result = Approval.Status.FAILED, str(exc)
    finally:
        APPROVING.reset(token)
    approval.save()
    _record(approval, actor, approval.result)
    return approval


@audited("approval.reject", _approval_target, (ApprovalError,))
def approval_reject(*, approval_id: int, reason: str, actor: User) -> Approval:
    """Refuse someone else's pending request, saying why: its requester reads the reason on the
    approvals page, and nothing of the change is carried out."""
    if not reason.strip():
        raise ApprovalError("say why it is rejected: its requester reads the reason")
    approval = _pending(approval_id)
    if approval.requested_by_id == actor.pk:
        raise ApprovalError("it is your own request: withdraw it instead")
    authorize(actor, APPROVER_PERMISSION, approval.pool)
    approval.status, approval.rejected_by = Approval.Status.REJECTED, actor
    approval.closed_at, approval.reason = timezone.now(), reason.strip()
    approval.save()
    _record(approval, actor, approval.reason)
    return approval


@audited("approval.withdraw", _approval_target, (ApprovalError,))
def approval_withdraw(*, approval_id: int, actor: User, reason: str = "") -> Approval:
    """Take back one's own pending request: no one can approve it any more."""
    approval = _pending(approval_id)
    if approval.requested_by_id != actor.pk:
        raise PermissionDenied(
            f"only {approval.requested_by.username}, who asked, can withdraw #{approval_id}"
        )
    approval.status, approval.closed_at = Approval.Status.WITHDRAWN, timezone.now()
    approval.reason = reason.strip()
    approval.save()
    _record(approval, actor, approval.reason)
    return approval


def _record(approval: Approval, actor: User, message: str) -> None:
    """The decision in the trail, and told to the webhook: the requester learns it there too."""
    notify_approval(
        approval_id=approval.pk,
        pool=approval.pool.name,
        event=f"approval_{approval.status}",
        what=f"{approval.action} asked by {approval.requested_by.username} is "
        f"{approval.status} by {actor.username}" + (f": {message}" if message else ""),
    )
    audit_record(
        actor=actor,
        target=f"approval:{approval.pk}",
        after={
            "action": approval.action,
            "requested_by": approval.requested_by.username,
            "status": approval.status,
        },
        message=message,
    )

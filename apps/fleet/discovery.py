"""Nodes found by the Prometheus that already scrapes them: its targets API lists the fleet's
scrape pool, whatever discovered the targets there (Kubernetes, Consul, EC2, file_sd).

A target is a node: its name from a label (DISCOVERY_NAME_LABEL, else its address), its pool
from another (DISCOVERY_POOL_LABEL), its HTTP and gRPC addresses from the metrics address's host
and the configured ports (or the target's `http_port` and `grpc_port` labels). A new target
becomes a node that joins its pool out of traffic (`Node.Stage.JOINING`: the reconcile loads and
warms it, then lets it serve); a node whose target has been gone for DISCOVERY_GRACE_S has
departed, kept with its history and no longer polled; one that comes back is the same node, and
joins again. Nodes registered by hand are never touched."""

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.audit.services import audit_record
from apps.fleet.addresses import validate_url
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool
from apps.fleet.stages import stage_set
from apps.fleet.traffic.haproxy import name_refusal
from controlplane import prometheus

ACTOR = "system:discovery"


@dataclass(frozen=True)
class Target:
    """A scrape target, read as a node."""

    name: str
    pool: str
    http_url: str
    grpc_url: str
    metrics_url: str


ADDRESSES = ("http_url", "grpc_url", "metrics_url")  # a node's, as its target gives them


@dataclass
class Discovered:
    """What one pass found: nodes to poll and reconcile now, and targets that are no node."""

    listed: int = 0
    joining: list[int] = field(default_factory=list)  # new, returned or moved: reconcile now
    departed: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # target -> why it is no node


def target_of(listed: dict) -> Target:
    """One entry of the targets API's `activeTargets` as a node; FleetError says why it is none
    (its addresses are checked by `_validate`, once it joins)."""
    labels = listed.get("labels", {})
    url = urlsplit(listed.get("scrapeUrl", ""))
    host, scheme = url.hostname or "", url.scheme or "http"
    pool = labels.get(settings.DISCOVERY_POOL_LABEL, "")
    if not pool:
        raise FleetError(f"no {settings.DISCOVERY_POOL_LABEL!r} label: which pool is it in?")
    name = labels.get(settings.DISCOVERY_NAME_LABEL) or re.sub(
        r"[^a-z0-9-]+", "-", f"{host}-{url.port or ''}".lower()
    ).strip("-")
    if refused := name_refusal(name, what="node name"):
        raise FleetError(refused)
    if not re.fullmatch(r"[-a-zA-Z0-9_]{1,60}", name) or not re.fullmatch(r"[-\w]{1,60}", pool):
        raise FleetError(f"node {name!r} in pool {pool!r}: names are letters, digits, - and _")
    where = f"[{host}]" if ":" in host else host
    http_port = labels.get("http_port") or settings.DISCOVERY_HTTP_PORT
    grpc_port = labels.get("grpc_port") or settings.DISCOVERY_GRPC_PORT
    return Target(
        name=name,
        pool=pool,
        http_url=f"{scheme}://{where}:{http_port}",
        grpc_url=f"{where}:{grpc_port}",
        metrics_url=url.geturl(),
    )


def _validate(target: Target) -> None:
    """FleetError when an address of `target` may not be contacted (addresses.validate_url,
    which resolves each name): asked of a target that joins, not of one listed as before."""
    validate_url(target.http_url, field="http address")
    validate_url(f"grpc://{target.grpc_url}", field="gRPC address")
    validate_url(target.metrics_url, field="metrics address")


def discover(now: datetime | None = None) -> Discovered:
    """One pass over the scrape pool's active targets (PrometheusUnavailable when it cannot be
    read: nothing departs on a Prometheus that did not answer)."""
    found = prometheus.active_targets(settings.DISCOVERY_SCRAPE_POOL)
    return nodes_sync(found, now or timezone.now())


def nodes_sync(found: list[dict], now: datetime) -> Discovered:
    """The fleet made to agree with `found` (the targets API's active targets): a handful of
    statements whatever the fleet's size, plus a few for each node that came, came back or
    went. Nodes listed as before cost no model instance and no name resolution, and are locked
    only to note that they were listed, in a transaction of their own before the rest: at 5,000
    nodes a pass that held them all while it worked held every worker's reconcile back
    meanwhile. What it locks, it locks at once (Node.objects.lock): a chunk's reconcile locks
    its nodes too."""
    outcome = Discovered()
    targets: dict[str, tuple[Target, str]] = {}  # by name: the target, and its scrape URL
    for listed in found:
        address = listed.get("scrapeUrl", "?")
        try:
            target = target_of(listed)
        except FleetError as exc:
            outcome.refused[address] = str(exc)
            continue
        targets.setdefault(target.name, (target, address))
    fields = ("name", "pk", "discovered_at", "stage", *ADDRESSES)
    known = {row[0]: row[1:] for row in Node.objects.filter(name__in=targets).values_list(*fields)}
    new: list[Target] = []
    again: dict[int, Target] = {}  # departed, or at other addresses
    noted: list[int] = []  # listed as before
    for name, (target, address) in list(targets.items()):
        if name in known:
            pk, discovered_at, stage, *addresses = known[name]
            if discovered_at is None:
                outcome.refused[target.metrics_url] = f"node {name} was registered by hand"
                continue
            held = dict(zip(ADDRESSES, addresses, strict=True))
            if stage != Node.Stage.DEPARTED and held == _addresses(target):
                noted.append(pk)
                continue
        if not _checked(target, address, outcome):
            del targets[name]  # no node of it is listed
        elif name in known:
            again[known[name][0]] = target
        else:
            new.append(target)
    # Noted first, each in id order (Node.objects.lock), so that what is looked at for nodes gone
    # is only what this pass did not list: with a short grace, every node otherwise.
    with transaction.atomic():
        Node.objects.filter(pk__in=noted).locked_update(listed_at=now)
    unseen = Node.objects.filter(
        discovered_at__isnull=False,
        listed_at__lt=now - timedelta(seconds=settings.DISCOVERY_GRACE_S),
    ).exclude(stage=Node.Stage.DEPARTED)
    gone: list[int] = []
    if found:
        # None departs on an empty listing: nothing listed at all is a scrape pool misnamed or
        # a Prometheus still discovering after a restart far more often than a fleet scaled to
        # zero, and departing every node would take the fleet out of traffic.
        gone = [pk for pk, name in unseen.values_list("pk", "name") if name not in targets]
    with transaction.atomic():
        Node.objects.filter(pk__in=[*again, *gone]).lock()
        outcome.joining += [_join_new(target, now).pk for target in new]
        for pk, target in again.items():
            if joined := _join_again(pk, target, now):
                outcome.joining.append(joined.pk)
        for node in unseen.filter(pk__in=gone):  # still unseen, now that it is locked
            _depart(node, now)
            outcome.departed.append(node.name)
    outcome.listed = len(targets)
    _note_refused(outcome.refused)
    return outcome


def _checked(target: Target, address: str, outcome: Discovered) -> bool:
    """Whether `target`'s addresses may be contacted; if not, it is refused, saying why."""
    try:
        _validate(target)
    except FleetError as exc:
        outcome.refused[address] = str(exc)
        return False
    return True


def _addresses(target: Target) -> dict[str, str]:
    return {key: getattr(target, key) for key in ADDRESSES}


def _join_new(target: Target, now: datetime) -> Node:
    pool, created = NodePool.objects.get_or_create(name=target.pool)
    node = Node.objects.create(
        name=target.name,
        pool=pool,
        stage=Node.Stage.JOINING,
        stage_changed_at=now,
        discovered_at=now,
        listed_at=now,
        **_addresses(target),
    )
    audit_record(
        actor=ACTOR,
        action="node.discover",
        target=f"node:{node.name}",
        after={"pool": pool.name, "pool_created": created, **_addresses(target)},
        message=f"listed by Prometheus' {settings.DISCOVERY_SCRAPE_POOL} scrape pool; "
        "joins out of traffic",
    )
    return node


def _join_again(pk: int, target: Target, now: datetime) -> Node | None:
    """A node listed again after it departed, or at other addresses (a replaced pod under the
    same name, empty and cold); None when another pass saw to it first."""
    node = Node.objects.get(pk=pk)  # locked by nodes_sync
    before = {key: getattr(node, key) for key in ADDRESSES}
    if node.stage != Node.Stage.DEPARTED and before == _addresses(target):
        return None
    for key, value in _addresses(target).items():
        setattr(node, key, value)
    node.listed_at = now
    node.save(update_fields=[*_addresses(target), "listed_at"])
    back = node.stage == Node.Stage.DEPARTED
    stage_set(
        node,
        Node.Stage.JOINING,
        actor=ACTOR,
        action="node.return",
        message=("listed again" if back else "listed at other addresses")
        + ": joins out of traffic until it serves its pool's release",
        at=now,
        before=before,
        after=_addresses(target),
    )
    return node


def _depart(node: Node, now: datetime) -> None:
    assert node.listed_at is not None  # discovered nodes are listed when found
    absent = (now - node.listed_at).total_seconds()
    stage_set(
        node,
        Node.Stage.DEPARTED,
        actor=ACTOR,
        action="node.depart",
        message=f"not listed by Prometheus for {absent:.0f} s "
        f"(grace {settings.DISCOVERY_GRACE_S:g} s): no longer polled",
        at=now,
    )


def _note_refused(refused: dict[str, str]) -> None:
    """Each target that is no node, said once in the trail until its reason changes (one read
    for all of them, however many)."""
    said: dict[str, str] = {}
    earlier = AuditEvent.objects.filter(
        action="node.discover", target_type="target", target_name__in=refused
    ).order_by("-created_at", "-id")
    for address, message in earlier.values_list("target_name", "message"):
        said.setdefault(address, message)  # the newest
    for address, why in refused.items():
        if said.get(address) != why:
            audit_record(
                actor=ACTOR,
                action="node.discover",
                target=f"target:{address}",
                result=AuditEvent.Result.FAILED,
                message=why,
            )

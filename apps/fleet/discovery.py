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
from functools import partial
from typing import NamedTuple
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
from apps.fleet.traffic.balancer import traffic_sync
from apps.fleet.traffic.haproxy import name_refusal
from apps.prometheus import client as prometheus

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


class Known(NamedTuple):
    """A discovered node as a pass reads it: no model instance for nodes listed as before."""

    pk: int
    discovered_at: datetime | None  # None: registered by hand
    stage: str
    unlisted_since: datetime | None
    pool: str
    addresses: tuple[str, ...]  # as ADDRESSES

    @property
    def present(self) -> bool:
        return self.stage != Node.Stage.DEPARTED

    @property
    def place(self) -> tuple[str, tuple[str, ...]]:
        return self.pool, self.addresses


def _place(target: Target) -> tuple[str, tuple[str, ...]]:
    return target.pool, tuple(_addresses(target).values())


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
    http_port = _port(labels, "http_port", settings.DISCOVERY_HTTP_PORT)
    grpc_port = _port(labels, "grpc_port", settings.DISCOVERY_GRPC_PORT)
    return Target(
        name=name,
        pool=pool,
        http_url=f"{scheme}://{where}:{http_port}",
        grpc_url=f"{where}:{grpc_port}",
        metrics_url=url.geturl(),
    )


def _port(labels: dict[str, str], label: str, default: int) -> int:
    """A port from the target's `label`, or `default` where it has none."""
    given = labels.get(label)
    if not given:
        return default
    if not (given.isascii() and given.isdigit() and 0 < int(given) < 65536):
        raise FleetError(f"label {label}={given!r} is not a port (1-65535)")
    return int(given)


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
    statements whatever the fleet's size, plus a few for each node that came, came back, moved
    or went. Nodes listed as before cost no model instance and no name resolution, and are
    locked only to note that they were listed, in a transaction of their own before the rest:
    at 5,000 nodes a pass that held them all while it worked held every worker's reconcile back
    meanwhile. What it locks, it locks at once (Node.objects.lock): a chunk's reconcile locks
    its nodes too.

    A listing decides nothing it cannot be sure of: a target joins only a pool open to
    discovery (NodePool.discoverable), one name listed by two targets is neither's, a node is
    never re-addressed while its old target is still listed, and a node departs only after
    passes that did not list it for the grace, at most DISCOVERY_DEPARTURES_PER_PASS a pass
    (a listing that lost half its targets for a pass departs none). A node not listed gets no
    traffic from that pass on (weight 0), and its weight back if it is listed again."""
    outcome = Discovered()
    by_name: dict[str, list[tuple[Target, str]]] = {}  # the target, and its scrape URL
    for listed in found:
        address = listed.get("scrapeUrl", "?")
        try:
            target = target_of(listed)
        except FleetError as exc:
            outcome.refused[address] = str(exc)
            continue
        by_name.setdefault(target.name, []).append((target, address))
    urls = {target.metrics_url for same in by_name.values() for target, _ in same}
    fields = ("name", "pk", "discovered_at", "stage", "unlisted_since", "pool__name", *ADDRESSES)
    known = {
        name: Known(pk, discovered_at, stage, unlisted_since, pool, tuple(addresses))
        for name, pk, discovered_at, stage, unlisted_since, pool, *addresses in Node.objects.filter(
            name__in=by_name
        ).values_list(*fields)
    }
    pools = dict(
        NodePool.objects.filter(
            name__in={same[0][0].pool for same in by_name.values()}
        ).values_list("name", "discoverable")
    )
    new: list[Target] = []
    again: dict[int, Target] = {}  # departed, moved, or at other addresses
    noted: list[int] = []  # listed as before (or kept as it was)
    back: list[int] = []  # ... and not listed by the pass before
    for name, same in by_name.items():
        target, address = same[0]
        node = known.get(name)
        if node is not None and node.discovered_at is None:
            outcome.refused[address] = f"node {name} was registered by hand"
            continue
        why = _ambiguous(target, same, node, urls, pools)
        unmoved = node is not None and node.present and node.place == _place(target)
        if node is not None and node.present and (why or unmoved):
            noted.append(node.pk)  # kept as it was
            if node.unlisted_since is not None:
                back.append(node.pk)
        if why:
            for _, where in same:
                outcome.refused[where] = why
        elif not unmoved and _checked(target, address, outcome):
            if node is None:
                new.append(target)
            else:
                again[node.pk] = target
    outcome.listed = len(by_name)
    # Once noted below: the nodes this pass did not list (a node listed anew is in `again`).
    unlisted = (
        Node.objects.filter(discovered_at__isnull=False, listed_at__lt=now)
        .exclude(stage=Node.Stage.DEPARTED)
        .exclude(pk__in=again)
    )
    # Noted first, each in id order (Node.objects.lock), so that what is looked at for nodes gone
    # is only what this pass did not list: with a short grace, every node otherwise.
    gone: list[int] = []
    with transaction.atomic():
        Node.objects.filter(pk__in=noted).locked_update(listed_at=now, unlisted_since=None)
        _weights_changed(back)
        if found:
            # Nothing is unlisted on an empty listing: nothing listed at all is a scrape pool
            # misnamed or a Prometheus still discovering after a restart far more often than a
            # fleet scaled to zero, and taking every node out would take the fleet out.
            newly = list(unlisted.filter(unlisted_since__isnull=True).values_list("pk", flat=True))
            Node.objects.filter(pk__in=newly).locked_update(unlisted_since=now)
            _weights_changed(newly)
            grace = now - timedelta(seconds=settings.DISCOVERY_GRACE_S)
            due = unlisted.filter(unlisted_since__lte=grace, unlisted_since__lt=now)
            gone = list(
                due.order_by("unlisted_since", "pk").values_list("pk", flat=True)[
                    : settings.DISCOVERY_DEPARTURES_PER_PASS
                ]
            )
    with transaction.atomic():
        Node.objects.filter(pk__in=[*again, *gone]).lock()
        outcome.joining += [_join_new(target, now).pk for target in new]
        for pk, target in again.items():
            if joined := _join_again(pk, target, now):
                outcome.joining.append(joined.pk)
        still = unlisted.filter(pk__in=gone, unlisted_since__isnull=False)  # now it is locked
        for leaving in still.order_by("unlisted_since", "pk"):
            _depart(leaving, now)
            outcome.departed.append(leaving.name)
    _note_refused(outcome.refused)
    return outcome


def _ambiguous(
    target: Target,
    same: list[tuple[Target, str]],
    node: Known | None,
    urls: set[str],
    pools: dict[str, bool],
) -> str:
    """Why the listing cannot be followed for `target` (a listed name), or "": a mistaken or
    hostile target must not take a node's name, its addresses or a closed pool."""
    if len(same) > 1:
        return f"node name {target.name} is listed by {len(same)} targets: none is taken for it"
    was = node.addresses[-1] if node is not None and node.present else target.metrics_url
    if was != target.metrics_url and was in urls:
        return (
            f"node {target.name}'s target {was} is still listed: not re-addressed to "
            f"{target.metrics_url}"
        )
    joins = node is None or not node.present or node.pool != target.pool
    if joins and not pools.get(target.pool, True):  # a pool it names anew is discovery's own
        return (
            f"pool {target.pool} does not take discovered nodes: a person marks it discoverable "
            "(on a protected pool, with a second person's approval)"
        )
    return ""


def _weights_changed(ids: list[int]) -> None:
    """The balancers of these nodes' pools told, once this commits: a node not listed any more
    (a pod stopping) gets no new request, one listed again its weight back."""
    if not ids:
        return
    for pool_id in set(Node.objects.filter(pk__in=ids).values_list("pool_id", flat=True)):
        transaction.on_commit(partial(traffic_sync, pool_id), robust=True)


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
    pool, created = NodePool.objects.get_or_create(
        name=target.pool, defaults={"discoverable": True}
    )
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
    """A node listed again after it departed, at other addresses (a replaced pod under the same
    name, empty and cold), or in another pool (it departs from the one and joins the other);
    None when another pass saw to it first."""
    node = Node.objects.select_related("pool").get(pk=pk)  # locked by nodes_sync
    before = {key: getattr(node, key) for key in ADDRESSES}
    moved = node.pool.name != target.pool
    if node.stage != Node.Stage.DEPARTED and before == _addresses(target) and not moved:
        return None
    if moved and node.stage != Node.Stage.DEPARTED:
        _depart(node, now, why=f"listed in pool {target.pool} now")
    if moved:
        before["pool"] = node.pool.name
        node.pool, _ = NodePool.objects.get_or_create(
            name=target.pool, defaults={"discoverable": True}
        )
    for key, value in _addresses(target).items():
        setattr(node, key, value)
    node.listed_at, node.unlisted_since = now, None
    node.save(update_fields=[*_addresses(target), "pool", "listed_at", "unlisted_since"])
    back = node.stage == Node.Stage.DEPARTED
    stage_set(
        node,
        Node.Stage.JOINING,
        actor=ACTOR,
        action="node.return",
        message=("listed again" if back else "listed at other addresses")
        + (f" in pool {target.pool}" if moved else "")
        + ": joins out of traffic until it serves its pool's release",
        at=now,
        before=before,
        after=_addresses(target) | ({"pool": target.pool} if moved else {}),
    )
    return node


def _depart(node: Node, now: datetime, why: str = "") -> None:
    assert node.listed_at is not None  # discovered nodes are listed when found
    absent = (now - node.listed_at).total_seconds()
    stage_set(
        node,
        Node.Stage.DEPARTED,
        actor=ACTOR,
        action="node.depart",
        message=(
            why
            or f"not listed by Prometheus for {absent:.0f} s "
            f"(grace {settings.DISCOVERY_GRACE_S:g} s)"
        )
        + ": no longer polled",
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

"""What changed, from the audit trail, as markers on charts: one per change (a deployment, a
rollout's step, a rollback), the node operations that carried it out told in its story rather
than drawn, and one per node health event or operation that no change explains."""

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from django.db.models import Count, F, Q, QuerySet, Subquery, Value, Window
from django.db.models.functions import Coalesce, RowNumber

from apps.audit.actions import Kind, kind_of, of_kind
from apps.audit.models import AuditEvent
from apps.fleet.models import Node


@dataclass(frozen=True)
class Marker:
    at: datetime
    text: str  # the whole story, on hover; one line per line
    label: str = ""  # a few words above the chart
    kind: str = "change"  # change, operation, down or up: how the line is drawn


HEALTH = of_kind(Kind.HEALTH)
OPERATIONS = of_kind(Kind.OPERATION)
# What changes what a node serves. Listed, not matched by prefix: one IN is several times
# cheaper to build than ORed LIKEs, and a chart pays it on every refresh.
CHANGES = of_kind(Kind.SERVING)
# Requests the product made where users sent too few: drawn apart, so that a chart's latency
# and throughput are not read as users' alone.
SYNTHETIC = of_kind(Kind.SYNTHETIC)
MAX_MARKERS = 60
# How a label says an action, where its own verb reads badly.
VERBS = {
    "deployment.set": "deploy",
    "deployment.remove": "remove",
    "pool.pin_tier": "pin",
    "pool.degrade": "step down",
    "pool.restore": "step back up",
}
MAX_EVENTS = 5000  # per chart, newest first: a deployment to 500 nodes and its operations
# Without a request id to link them (a rollout's tick runs from the beat), a change's events are
# those of its model within one tick, and an operation belongs to the change it soon follows.
SAME_TICK = timedelta(seconds=5)
FOLLOWS = timedelta(minutes=10)
LISTED_NODES = 6
LISTED_PER_NODE = 6
# A deployment to 500 nodes is a few thousand operations: the database counts them, and only the
# first few of each request are read, those its marker lists.
LISTED_OPERATIONS = LISTED_NODES * LISTED_PER_NODE


def change_markers(
    *, start: datetime, end: datetime, model: str = "", pool: str = "", node: str = ""
) -> list[Marker]:
    """What changed in [start, end]; only what touched `model`, `pool` or `node` when given.
    Targets name them (`pool:demo:rag_pipeline`, `node:demo-1:embedder`, `node:demo-1`,
    `rollout:7:rag_pipeline`, whose events say their pool); a node's events are its pool's too.
    One query in the common case, two when the window holds more than FEW events, whatever their
    number."""
    events = _events(start=start, end=end, model=model, pool=pool, node=node)
    newest = events.order_by("-created_at", "-id").values_list(*FIELDS)
    rows = [_Event._make((*row, 0)) for row in newest[: FEW + 1]]
    # Few: counted here, as a query with window functions costs more to build than this.
    rows = _counted_by_the_database(events, start) if len(rows) > FEW else _counted(rows)
    return fold(reversed(rows))[-MAX_MARKERS:]


FEW = 300  # events a chart reads as they are; past them, the database counts and picks


class _Event(NamedTuple):
    created_at: datetime
    actor: str
    action: str
    target_type: str
    target_name: str
    target_model: str
    after: dict[str, Any]
    result: str
    message: str
    request_id: str
    in_group: int  # an operation's: how many of its request, action and result there are


FIELDS = _Event._fields[:-1]  # what is read; in_group is counted


def _groups(row: _Event) -> tuple[str, str, str]:
    return (row.request_id, row.action, row.result)


def _counted(rows: list[_Event]) -> list[_Event]:
    """Newest first: each row's `in_group`, and only the first LISTED_OPERATIONS operations of
    each request kept, as the database's query below does."""
    sizes = Counter(map(_groups, rows))
    seen: Counter[tuple[str, str, str]] = Counter()
    kept = []
    for row in reversed(rows):
        seen[_groups(row)] += 1
        listed = seen[_groups(row)] <= LISTED_OPERATIONS
        if listed or not row.request_id or row.action not in OPERATIONS:
            kept.append(row._replace(in_group=sizes[_groups(row)]))
    return kept[::-1]


def _counted_by_the_database(events: QuerySet[AuditEvent], start: datetime) -> list[_Event]:
    """Bounded: the newest MAX_EVENTS events, found by the created_at index, never the whole
    window (a week at 500 nodes is a million operations). Of those, a request's operations
    are counted by the database and only the first few read: those its marker lists."""
    oldest = events.order_by("-created_at").values("created_at")[MAX_EVENTS - 1 : MAX_EVENTS]
    group = [F("request_id"), F("action"), F("result")]
    rows = (
        events.filter(created_at__gte=Coalesce(Subquery(oldest), Value(start)))
        .annotate(
            rank=Window(RowNumber(), partition_by=group, order_by=[F("created_at"), F("id")]),
            in_group=Window(Count("id"), partition_by=group),
        )
        .filter(Q(rank__lte=LISTED_OPERATIONS) | Q(request_id="") | ~Q(action__in=OPERATIONS))
        .order_by("-created_at", "-id")
    )
    return [_Event._make(row) for row in rows.values_list(*FIELDS, "in_group")]


def _events(
    *, start: datetime, end: datetime, model: str, pool: str, node: str
) -> QuerySet[AuditEvent]:
    window = AuditEvent.objects.filter(
        Q(result="ok") | Q(action__in=HEALTH + OPERATIONS),  # what failed on a node is news too
        action__in=CHANGES + OPERATIONS + HEALTH + SYNTHETIC,
        created_at__range=(start, end),
    )
    of_model = Q(target_model=model) if model else Q()
    at = Q()
    if pool:  # its nodes' events too, by a subquery of this one query: not a query per node
        nodes = Node.objects.filter(pool__name=pool).values("name")
        at &= (
            Q(target_type="pool", target_name=pool)
            | Q(target_type="node", target_name__in=nodes)
            | Q(target_type="rollout", after__pool=pool)
        )
    if node:
        at &= Q(target_type="node", target_name=node)
    scoped = window.filter(of_model & at)
    linked = Q()
    if model:  # the operations of its changes, on its steps too: a request id links them
        changes = scoped.filter(action__in=CHANGES).exclude(request_id="")
        linked |= at & Q(action__in=OPERATIONS, request_id__in=changes.values("request_id"))
    if node:  # the pool's changes that its operations carried out
        operations = scoped.filter(action__in=OPERATIONS).exclude(request_id="")
        named = Q(action__in=CHANGES, request_id__in=operations.values("request_id"))
        linked |= of_model & named & Q(target_type="pool")
    return window.filter((of_model & at) | linked) if linked else scoped


@dataclass
class _Marker:
    events: list[_Event]  # a change's own (a rollout step, its canary's deployments); or none
    operations: list[_Event] = field(default_factory=list)  # those read: the first of each request
    counted: dict[tuple[str, str, str], int] = field(default_factory=dict)  # see _Event.in_group

    @property
    def last(self) -> datetime:
        return self.events[-1].created_at

    @property
    def request_id(self) -> str:
        return self.events[0].request_id

    def add(self, operation: _Event) -> None:
        self.operations.append(operation)
        if operation.request_id:
            key = (operation.request_id, operation.action, operation.result)
            self.counted[key] = operation.in_group

    def totals(self) -> tuple[int, int]:
        """Operations and failed ones: counted by the database for a request, else here."""
        alone = [op for op in self.operations if not op.request_id]
        failed = sum(n for (_, _, result), n in self.counted.items() if result != "ok")
        return (
            sum(self.counted.values()) + len(alone),
            failed + sum(op.result != "ok" for op in alone),
        )


def fold(events: Iterable[_Event]) -> list[Marker]:
    """Events, oldest first, as markers: one per change, its node operations folded into it."""
    markers: list[_Marker] = []
    by_request: dict[str, _Marker] = {}
    by_model: dict[str, _Marker] = {}
    last_change: _Marker | None = None
    unexplained: dict[str, _Marker] = {}
    for event in events:
        model = event.target_model
        if event.action in CHANGES:
            found = by_request.get(event.request_id) if event.request_id else None
            same = by_model.get(model)
            if not event.request_id and same and not same.request_id:
                # Two rollout transitions are two changes, however close; its deployments not.
                apart = _rank(event) > 0 and any(_rank(e) > 0 for e in same.events)
                found = same if event.created_at - same.last <= SAME_TICK and not apart else None
            if found is None:
                found = _Marker([])
                markers.append(found)
            found.events.append(event)
            if event.request_id:
                by_request[event.request_id] = found
            by_model[model] = last_change = found
        elif event.action in OPERATIONS:
            owner = _owner(event, by_request, by_model.get(model), last_change)
            if owner is None and event.request_id:
                # A person's reload; or the rest of a change made before the window, one marker
                # for all of them, not a wall.
                owner = unexplained.get(event.request_id)
                if owner is None:
                    owner = unexplained[event.request_id] = _Marker([])
                    markers.append(owner)
            if owner is None:
                owner = _Marker([])
                markers.append(owner)
            owner.add(event)
        else:
            markers.append(_Marker([event]))
    return [_marker(each) for each in markers]


def _owner(
    event: _Event,
    by_request: dict[str, _Marker],
    same_model: _Marker | None,
    last_change: _Marker | None,
) -> _Marker | None:
    """The change an operation carried out. Its request id says so when it has one. Without one
    (a rollout's tick runs from the beat), the latest change of its model, or else of any (an
    ensemble's steps), that it follows closely enough."""
    if event.request_id:
        return by_request.get(event.request_id)
    for change in (same_model, last_change):
        if change is not None and event.created_at - change.last <= FOLLOWS:
            return change
    return None


def _marker(folded: _Marker) -> Marker:
    if not folded.events:  # node operations that no change here explains
        first = folded.operations[0]
        total, _ = folded.totals()
        if total == 1:
            return Marker(first.created_at, _story(first), _label(first), "operation")
        head, *per_node = _operations(folded)
        text = "\n".join([f"{head[:-1]} by {first.actor}:", *per_node])
        return Marker(first.created_at, text, f"{total} node operations", "operation")
    events = folded.events
    main = max(events, key=_rank)  # the first of the most telling
    lines = [_story(main)]
    lines += [f"also {_story(e)}" for e in events if e is not main][:LISTED_NODES]
    if folded.operations:
        head, *per_node = _operations(folded)
        if len(lines) == 1:
            lines[0] += f" — {head}"
        else:  # after the rest of the change, which they carried out too
            lines.append(head)
        lines += per_node
    return Marker(
        at=events[0].created_at, text="\n".join(lines), label=_label(main), kind=_kind(main)
    )


def _rank(event: _Event) -> int:
    """A release (a person's rollback) tells more than the rollout it aborted, and a rollout's
    step more than the deployments it made."""
    return {"rollout": 1, "release": 2}.get(event.action.split(".", 1)[0], 0)


def _kind(event: _Event) -> str:
    kind = kind_of(event.action)
    if kind == Kind.HEALTH:
        return "up" if event.action == "node.up" else "down"
    return {Kind.SYNTHETIC: "synthetic", Kind.OPERATION: "operation"}.get(kind, "change")


def _label(event: _Event) -> str:
    """`deployment.set pool:demo:rag_pipeline {version: 2}` reads `deploy rag_pipeline v2`."""
    if event.action == "perf.start":  # perf_analyzer's requests, one run on one node
        return f"perf_analyzer v{event.after.get('version')} on {event.after.get('node', '')}"
    if event.action == "perf.search":  # a step's configs tried on one node, out of traffic
        return f"search of {event.after.get('step')} on {event.after.get('node', '')}"
    if event.action in SYNTHETIC:
        nodes = ", ".join(event.after.get("nodes", []))
        return f"synthetic {event.after.get('rps', 0):g} req/s to {nodes}"
    verb = VERBS.get(event.action)
    verb = verb or event.action.split(".", 1)[-1]
    versions = event.after.get("versions") or [event.after.get("version")]
    subject = event.target_model or event.target_name
    return f"{verb} {subject}" + (f" v{versions[-1]}" if versions[-1] else "")


def _story(event: _Event) -> str:
    """`deploy rag_pipeline v2 on pool demo by ops`, and why, when the event says."""
    kind, name, model = event.target_type, event.target_name, event.target_model
    story = _label(event)
    if model:  # a node's own events name it in their label already
        where = {"pool": f"pool {name}", "rollout": f"rollout #{name}"}.get(kind, name)
        removed = event.action == "deployment.remove"
        story += f" {'in' if kind == 'rollout' else 'from' if removed else 'on'} {where}"
    story += f" by {event.actor}"
    if event.result != "ok" and event.action not in HEALTH:
        story += " (failed)"
    why = " ".join(event.message.split())
    return story + (f": {why[:200]}" if why else "")


def _operations(folded: _Marker) -> list[str]:
    """`9 node operations on 3 nodes:` then a line per node (`demo-1: load embedder, load
    retriever`), as many as fit in a hover box."""
    total, failed = folded.totals()
    per_node: dict[str, list[str]] = {}
    for op in folded.operations:
        node, model = op.target_name, op.target_model
        verb = op.action.split(".", 1)[1]
        per_node.setdefault(node, []).append(
            f"{verb} {model}" + (" (failed)" if op.result != "ok" else "")
        )
    head = f"{total} node operation{'s' if total > 1 else ''}"
    if total == len(folded.operations) and len(per_node) > 1:  # all of them read
        head += f" on {len(per_node)} nodes"
    lines = [head + (f", {failed} failed" if failed else "") + ":"]
    shown = [(node, done[:LISTED_PER_NODE]) for node, done in list(per_node.items())[:LISTED_NODES]]
    lines += [f"{node}: {', '.join(done)}" for node, done in shown]
    if more := total - sum(len(done) for _, done in shown):
        lines.append(f"… and {more} more")
    return lines

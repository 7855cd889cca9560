"""Desired state: what each node must serve. Computed once per pool, plus once per distinct set
of node-level overrides, in a bounded number of queries whatever the number of nodes; the pages,
the API and the reconciler all read it from here."""

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from django.db.models import IntegerField, Max, Q, QuerySet, TextField
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast

from apps.fleet.models import Deployment, Node
from apps.registry.codec import ensemble_steps, from_dict, pin_versions, to_dict
from apps.registry.ensembles import LATEST, Resolved, UnresolvedStep, pinned_steps
from apps.registry.models import Model, ModelVersion
from apps.registry.validation import is_ensemble


def digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def with_versions(config: dict[str, Any], versions: list[int]) -> dict[str, Any]:
    return to_dict(pin_versions(from_dict(config), versions))


@dataclass(frozen=True)
class DesiredModel:
    name: str
    versions: tuple[int, ...]
    config: dict[str, Any]  # the load request's config override, version policy included
    ensemble: bool
    depth: int = 0  # 0 for a model, 1 + its deepest step for an ensemble: load in this order

    @cached_property
    def digest(self) -> str:
        return digest(self.config)


class DesiredStateError(Exception):
    """A deployment that cannot be turned into loads (a version or a step is missing)."""


class Desired(dict[str, DesiredModel]):
    """What a node must serve, by model name; never changed once computed, so its plan digest
    is worked out once: the nodes of a pool share one, and a release asks for it with every
    node's plan and every look again of a run (runner.Looks)."""

    @cached_property
    def plan_digest(self) -> str:
        return digest({name: model.config for name, model in sorted(self.items())})


class Want(NamedTuple):
    """What one deployment asks for of its model."""

    version: int
    baseline: int | None  # kept READY beside it
    label: str  # the deployment in words
    standby: int | None = None  # a pipeline release whose steps load beside, unserved

    @property
    def numbers(self) -> list[int]:
        return [n for n in (self.version, self.baseline, self.standby) if n]


Wanted = dict[str, Want]  # by model name


@dataclass
class _Registry:
    """The registry versions a computation needs, each read and parsed once."""

    configs: dict[tuple[str, int], Any] = field(default_factory=dict)  # parsed ModelConfig
    latest: dict[str, int] = field(default_factory=dict)  # newest published version
    known: set[str] = field(default_factory=set)  # model names that exist

    def fetch(self, wanted: Iterable[tuple[str, int]]) -> None:
        """Read the wanted versions and, in rounds (one per level of ensemble nesting), the
        steps they pin, so that resolving never queries again."""
        pending = set(wanted)
        while pending:
            names = {name for name, _ in pending} - self.known
            self.known |= set(Model.objects.filter(name__in=names).values_list("name", flat=True))
            self._read_latest({name for name, version in pending if version == LATEST})
            exact = {(n, self.latest.get(n, LATEST) if v == LATEST else v) for n, v in pending}
            pending = set()
            for name, version, config in self._read(
                {(n, v) for n, v in exact if v != LATEST and (n, v) not in self.configs}
            ):
                self.configs[(name, version)] = parsed = from_dict(config)
                pending |= set(ensemble_steps(parsed))

    def _read_latest(self, names: set[str]) -> None:
        names = (names & self.known) - set(self.latest)
        if names:
            published = ModelVersion.objects.filter(
                model__name__in=names, status=ModelVersion.Status.PUBLISHED
            )
            newest = published.values("model__name").annotate(newest=Max("version"))
            self.latest |= dict(newest.values_list("model__name", "newest"))

    def _read(self, pairs: set[tuple[str, int]]) -> list[tuple[str, int, dict[str, Any]]]:
        by_name: dict[str, set[int]] = {}
        for name, version in pairs:
            if name in self.known:
                by_name.setdefault(name, set()).add(version)
        if not by_name:
            return []
        query = Q()
        for name, versions in by_name.items():
            query |= Q(model__name=name, version__in=versions)
        found = ModelVersion.objects.filter(query)
        return list(found.values_list("model__name", "version", "config"))

    def resolve(self, name: str, version: int) -> Resolved:
        """A step's pin, from what `fetch` read."""
        number = self.latest.get(name) if version == LATEST else version
        if number is not None and (name, number) in self.configs:
            return Resolved(self.configs[(name, number)], number)
        if name not in self.known:
            return Resolved(None, reason=f"model '{name}' is not in the registry")
        wanted = "a published version" if version == LATEST else f"version v{version}"
        return Resolved(None, reason=f"model '{name}' has no {wanted}")


def _compute(wanted: Wanted, registry: _Registry) -> Desired:
    configs: dict[str, dict[int, Any]] = {}  # model -> version -> parsed config
    for name, want in wanted.items():
        releases = []
        for number in want.numbers:
            if (name, number) not in registry.configs:
                raise DesiredStateError(f"{want.label}: {name} v{number} is not in the registry")
            releases.append(release := registry.configs[(name, number)])
            if number != want.standby:  # a standby pipeline loads its steps, not itself
                configs.setdefault(name, {})[number] = release
        for release in releases:
            try:
                steps = pinned_steps(release, registry.resolve, nested=True)
            except UnresolvedStep as exc:
                raise DesiredStateError(f"{want.label}: {exc}") from None
            for (step, number), config in steps.items():
                configs.setdefault(step, {}).setdefault(number, config)

    def depth(name: str) -> int:
        steps = [s for config in configs[name].values() for s, _ in ensemble_steps(config)]
        return 1 + max(map(depth, steps)) if steps else 0  # validation rules out cycles

    desired = Desired()
    for name, by_version in configs.items():
        # Triton keeps one config per model: the newest wanted version's config serves them all.
        versions = sorted(by_version)
        newest = by_version[versions[-1]]
        config = to_dict(pin_versions(newest, versions))
        desired[name] = DesiredModel(
            name, tuple(versions), config, is_ensemble(newest), depth(name)
        )
    return desired


class FleetDesired:
    """The desired state of every node of some pools. Nodes that share their deployments (every
    node of a pool without overrides) share one computed state."""

    def __init__(self, pools: dict[int, Wanted], overrides: dict[int, Wanted]) -> None:
        self._pools, self._overrides = pools, overrides
        self._registry = _Registry()
        wanted = {*_pairs(pools.values()), *_pairs(overrides.values())}
        self._registry.fetch(wanted)
        self._states: dict[tuple, Desired | DesiredStateError] = {}

    def of(self, node: Node) -> Desired:
        """Raises DesiredStateError when a deployment cannot be resolved (a version or a step
        missing from the registry)."""
        return self.with_change(node, {})

    def with_change(self, node: Node, change: Wanted) -> Desired:
        """The node's desired state were `change` deployed on it too: a preview. Raises
        DesiredStateError as `of` does."""
        self._registry.fetch(_pairs([change]))
        wanted = self._pools.get(node.pool_id, {}) | self._overrides.get(node.pk, {}) | change
        key = tuple(sorted(wanted.items()))
        if key not in self._states:
            try:
                self._states[key] = _compute(wanted, self._registry)
            except DesiredStateError as exc:
                self._states[key] = exc
        found = self._states[key]
        if isinstance(found, DesiredStateError):
            raise found
        return found

    @property
    def overridden(self) -> set[int]:
        """The nodes with deployments of their own (a canary's): their state is their own."""
        return set(self._overrides)

    def names(self, node: Node) -> set[str]:
        """The models the node must serve; empty when its desired state cannot be resolved."""
        try:
            return set(self.of(node))
        except DesiredStateError:
            return set()


def _pairs(groups: Iterable[Wanted]) -> set[tuple[str, int]]:
    return {
        (name, number)
        for wanted in groups
        for name, want in wanted.items()
        for number in want.numbers
    }


# Fleet desired states lately built, by their inputs: a page shown again reuses one while no
# deployment of its pools and no registry version changed (5,000 nodes' pages in 50 pools: the
# states of 50 pools, computed once per change rather than once per view).
_FLEETS: OrderedDict[tuple, FleetDesired] = OrderedDict()
_FLEETS_MAX = 16


def fleet_desired(*, pool_ids: Iterable[int] | None = None) -> FleetDesired:
    """Desired state for the nodes of `pool_ids` (every pool when None): one small query when
    nothing changed since it was last built, a handful more when something did, however many
    nodes and deployments there are. Kept under its inputs only when they read the same after
    it was built, as `node_desired` does."""
    deployments = Deployment.objects.all()
    ids = None if pool_ids is None else tuple(sorted(set(pool_ids)))
    if ids is not None:
        # The nodes by their pool's index: a join would read every node of the fleet.
        nodes = Node.objects.filter(pool_id__in=ids).values("pk")
        deployments = deployments.filter(Q(pool_id__in=ids) | Q(node_id__in=nodes))
    key = (ids, _fleet_inputs(deployments))
    if key in _FLEETS:
        _FLEETS.move_to_end(key)
        return _FLEETS[key]
    pools: dict[int, Wanted] = {}
    overrides: dict[int, Wanted] = {}
    for d in deployments.select_related("model", "pool", "node"):
        if d.node_id is not None:
            group = overrides.setdefault(d.node_id, {})
        else:
            group = pools.setdefault(d.pool_id, {})  # type: ignore[arg-type]
        group[d.model.name] = Want(d.version, d.baseline_version, str(d), d.standby_version)
    found = FleetDesired(pools, overrides)
    if _fleet_inputs(deployments) == key[1]:
        _FLEETS[key] = found
        if len(_FLEETS) > _FLEETS_MAX:
            _FLEETS.popitem(last=False)
    return found


def _fleet_inputs(deployments: QuerySet[Deployment]) -> tuple:
    """The deployments, each as of its last change, with a stamp of the registry
    (`_REGISTRY_STAMP`), in one statement; no deployment needs no stamp: nothing is wanted of
    the registry then."""
    fields = ("id", "pool_id", "node_id", "version", "baseline_version", "standby_version")
    # The moment as the database writes it: compared as text, never parsed (thousands of them).
    changed = Cast("updated_at", TextField())
    rows = deployments.order_by("id").annotate(changed=changed, stamp=_REGISTRY_STAMP)
    return tuple(rows.values_list(*fields, "changed", "stamp"))


# Grows with every change of the registry's published versions (a step pinned to the latest): a
# registered version's config never changes, and a version only moves forward (draft, published,
# deprecated). A scalar subquery, computed once however many deployments it is read with.
_STAMP_SQL = (  # ModelVersion's table, its statuses as parameters
    "SELECT COALESCE(SUM(CASE WHEN status = %s THEN 1 WHEN status = %s THEN 2 ELSE 0 END), 0) "
    "FROM registry_modelversion"
)
_REGISTRY_STAMP = RawSQL(  # noqa: S611  # _STAMP_SQL
    _STAMP_SQL,
    (ModelVersion.Status.PUBLISHED, ModelVersion.Status.DEPRECATED),
    output_field=IntegerField(),
)


def targeting(node: Node) -> QuerySet[Deployment]:
    """The deployments that target the node: its pool's and its own."""
    return Deployment.objects.filter(Q(pool_id=node.pool_id) | Q(node=node))


def desired_inputs(node: Node) -> tuple:
    """What a node's desired state is computed from, in one small query: the deployments that
    target it, each as of its last change, with a stamp of the registry (`_fleet_inputs`). They
    can come back, which `node_desired` allows for."""
    return _fleet_inputs(targeting(node))


# Desired states lately computed, by their inputs: the nodes of a pool share one, so a worker
# reconciling them one after another computes it once per change, not once per node.
_COMPUTED: OrderedDict[tuple, Desired | DesiredStateError] = OrderedDict()
_COMPUTED_MAX = 256


def node_desired(node: Node) -> Desired:
    """One node's desired state: the pool's deployments, with the node's own on top. Computed
    again only when its inputs changed. Raises DesiredStateError when a deployment cannot be
    resolved."""
    found = _desired(node, desired_inputs(node))
    if isinstance(found, DesiredStateError):
        raise found
    return found


def nodes_desired(nodes: list[Node]) -> dict[int, Desired | DesiredStateError]:
    """`node_desired` of each node (or why it has none), their inputs read in one statement:
    a reconcile plans a chunk of nodes together."""
    targeted = Q(pool_id__in={node.pool_id for node in nodes}) | Q(
        node_id__in=[n.pk for n in nodes]
    )
    rows = _fleet_inputs(Deployment.objects.filter(targeted))
    return {
        node.pk: _desired(node, tuple(r for r in rows if r[1] == node.pool_id or r[2] == node.pk))
        for node in nodes
    }


def _desired(node: Node, key: tuple) -> Desired | DesiredStateError:
    """The node's desired state from its inputs (`desired_inputs`, read just now). A state is
    kept under its inputs only when they read the same after it was computed: inputs can come
    back (a canary's node deployment dropped leaves the pool's as it was; no deployment at
    all), and a change committed between the two reads must not be kept under the inputs from
    before it."""
    if key in _COMPUTED:
        _COMPUTED.move_to_end(key)
        return _COMPUTED[key]
    try:
        found: Desired | DesiredStateError = fleet_desired(pool_ids=[node.pool_id]).of(node)
    except DesiredStateError as exc:
        found = exc
    if desired_inputs(node) == key:
        _COMPUTED[key] = found
        if len(_COMPUTED) > _COMPUTED_MAX:
            _COMPUTED.popitem(last=False)
    return found

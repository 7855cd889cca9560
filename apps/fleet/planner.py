"""What to do on one node to reach its desired state: a pure function of desired and observed.

Make before break: when a step model changes version, it first serves old and new together, the
ensembles switch, and only then does it narrow to the new versions, so a pipeline keeps serving.
Models Triton is busy loading or unloading are left for the next pass; a config that failed is not
retried by the reconciler (a person retries it, or the desired state changes).
"""

from dataclasses import dataclass
from typing import Any

from apps.fleet.desired import DesiredModel, digest, with_versions
from apps.fleet.memory import Room
from apps.registry.codec import step_names


@dataclass(frozen=True)
class Observed:
    ready: frozenset[int]
    busy: bool = False  # some version LOADING or UNLOADING
    digest: str = ""  # config digest of the last successful load on this node
    failed: frozenset[str] = frozenset()  # digests whose last attempt failed


@dataclass(frozen=True)
class Action:
    kind: str  # load or unload
    model: str
    versions: tuple[int, ...]
    config: dict[str, Any] | None = None
    digest: str = ""


def plan(
    desired: dict[str, DesiredModel],
    observed: dict[str, Observed],
    managed: dict[str, bool],
    room: Room | None = None,
) -> list[Action]:
    """`managed` maps the models the reconciler may unload (those the node owns) to
    whether each is an ensemble; any other model on the node is left alone. On a memory-aware
    node, `room` says what it has free: a step whose old and new versions would not fit side by
    side unloads first and loads its new versions alone (break before make; on a pool behind a
    balancer the node is out of traffic meanwhile)."""
    first: list[Action] = []
    narrow: list[Action] = []
    held: set[str] = set()  # models this plan cannot bring to their wanted versions
    for model in sorted(desired.values(), key=lambda m: (m.depth, m.name)):
        seen = observed.get(model.name, Observed(frozenset()))
        wanted = frozenset(model.versions)
        if seen.busy or held & step_names(model.config):
            # Busy, or a step is not ready for it: Triton would refuse the ensemble, and a
            # refused config is not retried. The next pass plans it.
            held.add(model.name)
            continue
        if seen.ready == wanted and seen.digest == model.digest:
            continue
        final = Action("load", model.name, model.versions, model.config, model.digest)
        if model.ensemble or not seen.ready - wanted:
            if final.digest in seen.failed:
                held.add(model.name)
            else:
                first.append(final)
            continue
        # Narrowing waits until the ensembles have switched; missing versions load first, beside
        # the ones still serving.
        if not wanted <= seen.ready:
            if room is not None:
                added = room.need((model.name, v) for v in wanted - seen.ready)
                freed = room.need((model.name, v) for v in seen.ready - wanted)
                if not room.fits(added) and room.fits(added, freed=freed):
                    if final.digest not in seen.failed:
                        first += [Action("unload", model.name, ()), final]
                    room.take(added - freed)
                    continue
                room.take(added)  # what does not fit at all is refused when it is sent
            versions = tuple(sorted(seen.ready | wanted))
            config = with_versions(model.config, list(versions))
            union = Action("load", model.name, versions, config, digest(config))
            if union.digest in seen.failed:
                held.add(model.name)
                continue
            first.append(union)
        if final.digest not in seen.failed:
            narrow.append(final)
    unloads = [
        Action("unload", name, ())
        for name, seen in sorted(
            observed.items(), key=lambda item: (not managed.get(item[0]), item[0])
        )
        if name not in desired and name in managed and seen.ready and not seen.busy
    ]
    return first + narrow + unloads

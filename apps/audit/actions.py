"""Every action the audit trail records, named once, with its kind. The readers of the trail
(the charts' markers, an incident's suspects and timeline) choose events by kind, never by a list
of their own; `audit_record` refuses a name that is not here.

A name is `<subject>.<verb>[_<object>]`, the verb in the imperative (`pool.set_traffic`,
`version.create`, `node.warm_up`), as the person or the part of the system that acts would say
it; a rollout's state changes are named by the state entered (`rollout.paused`). Events written
before a rename keep their old name (the trail is never rewritten): `registry.memory_set` is
`version.set_memory` now, `registry.{slo,budget,fallback}_set` are `model.set_*`,
`registry.version_create` and `registry.version_status` are `version.create` and
`version.set_status`, `user.role_set` and `user.pool_role_set` are `user.set_role` and
`user.set_pool_role`, `node.warmup` is `node.warm_up`, `pool.weights` is `pool.set_weights`,
`deployment.window_closed` is `deployment.close_window`, `node.release` is `node.clear`,
`rollout.window_skipped` is
`rollout.skip_window` and `rollout.resumed` is `rollout.resume`."""

from enum import StrEnum


class Kind(StrEnum):
    SERVING = "serving"  # changes what nodes serve: a chart marker, an incident suspect
    ROLLOUT = "rollout"  # a rollout's course that serves nothing new by itself: suspected
    OPERATION = "operation"  # a node's load, unload or reload: told in its change's story
    REQUEST = "request"  # a person asking a node for an operation: suspected
    REGISTRY = "registry"  # a version created or its status changed: suspected
    HEALTH = "health"  # a node down, up or flapping: drawn on the charts
    SYNTHETIC = "synthetic"  # requests the product sent itself: drawn apart
    UPKEEP = "upkeep"  # the fleet keeping itself: drift, drains, warm-ups, weights
    SETTING = "setting"  # a setting of a node, pool, model, user, token or template
    QUALITY = "quality"  # an evaluation run started
    APPROVAL = "approval"
    INCIDENT = "incident"
    ACCESS = "access"  # sign-in and API refusals
    HOUSEKEEPING = "housekeeping"  # the trail's own archiving and retention


_BY_KIND: dict[Kind, list[str]] = {
    Kind.SERVING: [
        "node.join",
        "deployment.set",
        "deployment.remove",
        "rollout.step",
        "rollout.switch",
        "rollout.promoting",
        "rollout.succeeded",
        "rollout.aborting",
        "rollout.rolled_back",
        "release.rollback",
        "release.fallback",
        "pool.pin_tier",
        "pool.degrade",
        "pool.restore",
        "pool.confirm_restore",
    ],
    # A person's commands (`rollout.pause`...) are named for their refusals; what they did is
    # the transition they made (`rollout.paused`...).
    Kind.ROLLOUT: [
        "rollout.start",
        "rollout.tune",  # an advice accepted: new versions and their rollout's start
        "rollout.progressing",
        "rollout.standby",
        "rollout.paused",
        "rollout.resume",
        "rollout.failed",
        "rollout.skip_window",
        "rollout.verdict",  # a round's verdict, shown on the timeline (not written)
        "rollout.pause",
        "rollout.promote",
        "rollout.abort",
        "rollout.roll_back",
        "rollout.retry",
        "rollout.act",
    ],
    Kind.OPERATION: ["operation.load", "operation.unload", "operation.reload"],
    Kind.REQUEST: [
        "operation.request_load",
        "operation.request_unload",
        "operation.request_reload",
        "operation.override",
        "node.operate",
    ],
    Kind.REGISTRY: ["version.create", "version.set_status"],
    Kind.HEALTH: [
        "node.down",
        "node.up",
        "node.flapping",
        "node.discover",
        "node.return",
        "node.depart",
        "node.quarantine",
    ],
    Kind.SYNTHETIC: ["synthetic_load.start", "perf.start", "perf.search"],
    Kind.UPKEEP: [
        "node.drift",
        "node.drain",
        "node.warm_up",
        "pool.set_weights",
        "pool.traffic_drift",
        "deployment.close_window",
        "pool.freeze_tiers",
        "pool.scale",
    ],
    Kind.SETTING: [
        "node.register",
        "node.adopt",
        "node.set_memory",
        "node.clear",
        "pool.set_protected",
        "pool.set_discoverable",
        "pool.set_queue",
        "pool.set_rollback_window",
        "pool.set_traffic",
        "pool.set_tiers",
        "pool.unpin_tier",
        "pool.set_scaling",
        "pool.pin_scaling",
        "desired.apply",
        "registry.import",
        "version.set_memory",
        "model.set_slo",
        "model.set_budget",
        "model.set_fallback",
        "analysis_template.save",
        "evaluation_set.import",
        "user.set_role",
        "user.set_pool_role",
        "token.create",
        "token.revoke",
    ],
    Kind.QUALITY: ["evaluation.start"],
    Kind.APPROVAL: ["approval.request", "approval.approve", "approval.reject", "approval.withdraw"],
    Kind.INCIDENT: [
        "incident.open",
        "incident.update",
        "incident.alert",
        "incident.resolve",
        "incident.rollback",
    ],
    Kind.ACCESS: ["login.locked_out", "api.read", "api.write", "registry.download"],
    Kind.HOUSEKEEPING: ["audit.archive", "retention.prune"],
}

ACTIONS: dict[str, Kind] = {name: kind for kind, names in _BY_KIND.items() for name in names}


def of_kind(*kinds: Kind) -> list[str]:
    """The actions of those kinds: a list, as an `action__in` filter takes it."""
    return [name for kind in kinds for name in _BY_KIND[kind]]


def kind_of(action: str) -> Kind:
    return ACTIONS[action]

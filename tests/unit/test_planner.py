from apps.fleet.planner import plan
from tests.support.planning import MANAGED, desired, kinds, ready


def test_a_fresh_node_loads_steps_before_the_ensemble() -> None:
    want = {"pipe": desired("pipe", 1, ensemble=True), "step": desired("step", 1)}
    assert kinds(plan(want, {}, MANAGED)) == [("load", "step", (1,)), ("load", "pipe", (1,))]


def test_a_converged_node_gets_nothing() -> None:
    want = {"step": desired("step", 2)}
    assert plan(want, {"step": ready(2, digest=want["step"].digest)}, MANAGED) == []


def test_a_version_switch_makes_before_it_breaks() -> None:
    want = {"pipe": desired("pipe", 2, ensemble=True), "step": desired("step", 2)}
    seen = {"pipe": ready(1), "step": ready(1)}
    assert kinds(plan(want, seen, MANAGED)) == [
        ("load", "step", (1, 2)),  # old and new side by side
        ("load", "pipe", (2,)),  # the ensemble switches
        ("load", "step", (2,)),  # then the old step version goes
    ]


def test_a_changed_config_with_the_same_versions_reloads() -> None:
    want = {"step": desired("step", 1)}
    assert kinds(plan(want, {"step": ready(1, digest="older")}, MANAGED)) == [
        ("load", "step", (1,))
    ]


def test_undesired_managed_models_unload_ensembles_first_and_unmanaged_stay() -> None:
    seen = {"old": ready(1), "oldpipe": ready(3), "someone_elses": ready(1)}
    assert kinds(plan({}, seen, MANAGED)) == [("unload", "oldpipe", ()), ("unload", "old", ())]


def test_busy_models_wait_for_the_next_pass() -> None:
    want = {"step": desired("step", 2)}
    assert plan(want, {"step": ready(busy=True)}, MANAGED) == []
    assert plan({}, {"old": ready(1, busy=True)}, MANAGED) == []


def test_an_ensemble_waits_for_a_busy_or_refused_step() -> None:
    """Triton refuses an ensemble whose step version is not READY, and a refused config is not
    retried: loading it now would leave the pipeline stuck."""
    want = {"pipe": desired("pipe", 2, ensemble=True), "step": desired("step", 2)}
    assert plan(want, {"pipe": ready(1), "step": ready(1, 2, busy=True)}, MANAGED) == []
    refused = want["step"].digest
    union = plan(want, {"pipe": ready(1), "step": ready(1)}, MANAGED)[0].digest
    assert plan(want, {"pipe": ready(1), "step": ready(1, failed=(union, refused))}, MANAGED) == []


def test_a_config_that_failed_is_not_retried_by_the_reconciler() -> None:
    want = {"step": desired("step", 3)}
    assert plan(want, {"step": ready(failed=(want["step"].digest,))}, MANAGED) == []
    (switch, _) = plan(want, {"step": ready(1)}, MANAGED)
    assert switch.versions == (1, 3)
    assert plan(want, {"step": ready(1, failed=(switch.digest,))}, MANAGED) == []

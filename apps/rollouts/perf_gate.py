"""The performance gate before traffic: once the first step's canary is READY, and while its node
is still drained, Triton's perf_analyzer measures the canary and the baseline on that node, one
after the other and then again in the other order (canary, baseline, baseline, canary: a node
that slows down meanwhile slows both alike), each served with its own config (an ensemble's
versions share one config when loaded beside each other, so the node is switched between them,
through its desired state, and read back before each measurement). At each concurrency of the
template's range, the canary's throughput and P99 must stay within its tolerances of the
baseline's; a failure rolls back before a single user request reached the canary, a run that
could not measure pauses with its reason, and nothing passes on missing figures."""

from datetime import datetime
from statistics import fmean

from apps.fleet import selectors
from apps.fleet.models import Node
from apps.fleet.services.deployments import deployment_set
from apps.performance.analyzer import PerfError, concurrency_range
from apps.performance.models import PerfPoint, PerfRun
from apps.performance.runs import perf_deadline
from apps.performance.services import perf_start
from apps.rollouts.ending import roll_back
from apps.rollouts.members import Member, Scope
from apps.rollouts.models import Rollout, Round
from apps.rollouts.plans import Analysis
from apps.rollouts.results import Kind, Result
from apps.rollouts.transitions import ACTOR, pause, record
from apps.rollouts.verdicts import Verdict

CANARY, BASELINE = "canary", "baseline"
SIDES = (CANARY, BASELINE, BASELINE, CANARY)  # the runs, in their order


def perf_gate(rollout: Rollout, where: Scope, spec: Analysis, now: datetime) -> bool:
    """Whether the gate passed now; until then, one run after the other is started and waited
    on, the node switched between the two versions before each side's first run."""
    runs = list(rollout.perf_runs.select_related("model").order_by("id"))
    last = runs[-1] if runs else None
    if last is not None and not last.finished:
        if now > perf_deadline(last):
            why = f"run #{last.pk} did not finish in time (its worker may have been lost)"
            return _again(rollout, where, why)
        return False
    if last is not None and last.status == PerfRun.Status.FAILED:
        return _again(rollout, where, last.error)
    if len(runs) == len(SIDES):
        return _judged(rollout, where, runs, spec, now)
    node, side = where.canary[0], SIDES[len(runs)]
    since = last.finished_at if last and last.finished_at else now  # a switch starts then
    if not _serving(where, node, side):
        if (now - since).total_seconds() > spec.converge_timeout_s:
            versions = ", ".join(f"{m.model.name} v{_version(m, side)}" for m in where.released)
            why = f"{node.name} did not serve {versions} within {spec.converge_timeout_s} s"
            return _again(rollout, where, why)
        return False
    lead = where.lead
    try:
        run = perf_start(
            node=node,
            model_name=lead.model.name,
            version=_version(lead, side),
            concurrencies=concurrency_range(spec.perf_concurrency, spec.perf_timeout_s),
            requests=spec.perf_requests,
            timeout_s=spec.perf_timeout_s,
            purpose=f"rollout #{rollout.pk}, performance gate: {side}",
            actor=ACTOR,
        )
    except PerfError as exc:
        return _again(rollout, where, str(exc))
    rollout.perf_runs.add(run)
    return False


def perf_under_way(rollout: Rollout) -> bool:
    """Whether the gate has started measuring (its node may serve the baseline alone now)."""
    return rollout.step == 0 and rollout.perf_passed_at is None and rollout.perf_runs.exists()


def _version(member: Member, side: str) -> int:
    return member.canary if side == CANARY else member.baseline


def _serving(where: Scope, node: Node, side: str) -> bool:
    """Whether `node` is read back serving `side` alone (the canary with the baseline kept
    beside it, as its step wants it, or the baseline with its own config); asks for it if not
    (idempotent: a deployment already asked for changes nothing)."""
    wanted: dict[str, set[int]] = {}
    for member in where.released:
        beside = member.beside if side == CANARY else None
        version = _version(member, side)
        deployment_set(
            model_name=member.model.name, version=version, baseline=beside, node=node, actor=ACTOR
        )
        wanted[member.model.name] = {version} | ({beside} if beside else set())
    readings = selectors.observed_many([node], list(wanted))
    return all(readings[(node.pk, name)][0] == versions for name, versions in wanted.items())


def _again(rollout: Rollout, where: Scope, why: str) -> bool:
    """Pause on a gate that could not measure, its node asked to serve the canary again (still
    drained), as the step wants it; a resume runs the gate again from its first run."""
    _serving(where, where.canary[0], CANARY)
    rollout.perf_runs.clear()
    pause(rollout, f"performance gate: {why}; resume to run it again")
    return False


def _judged(
    rollout: Rollout, where: Scope, runs: list[PerfRun], spec: Analysis, now: datetime
) -> bool:
    found = perf_results(runs, spec)
    verdict = next(
        (v for v in (Verdict.FAILURE, Verdict.INCONCLUSIVE) if any(r.verdict == v for r in found)),
        Verdict.SUCCESS,
    )
    record(rollout, found, verdict, Round.Kind.PERF)
    why = "; ".join(r.detail for r in found if r.verdict == verdict)
    if verdict == Verdict.INCONCLUSIVE:
        return _again(rollout, where, why)
    if verdict == Verdict.FAILURE:
        rollout.first_failure_at = rollout.first_failure_at or now
        roll_back(rollout, f"performance gate failed before any traffic: {why}")
        return False
    rollout.perf_passed_at = now
    return True


def perf_results(runs: list[PerfRun], spec: Analysis) -> list[Result]:
    """At each concurrency, the canary's mean throughput and P99 over its runs against the
    baseline's: failed beyond the tolerances, and where a side lacks a figure (never passed on
    missing ones)."""
    points: dict[tuple[str, int], list[PerfPoint]] = {}
    for side, run in zip(SIDES, runs, strict=True):
        for point in run.points.all():
            points.setdefault((side, point.concurrency), []).append(point)
    canary = next(run for side, run in zip(SIDES, runs, strict=True) if side == CANARY)
    baseline = next(run for side, run in zip(SIDES, runs, strict=True) if side == BASELINE)
    query = (
        f"perf_analyzer on {canary.node_name}: {canary.model.name} v{canary.version} against "
        f"v{baseline.version}, {canary.requests} requests a run at each concurrency"
    )
    evidence: dict[str, object] = {"runs": [run.pk for run in runs]}
    found = []
    for n in canary.concurrency_range:
        mine, theirs = points.get((CANARY, n), []), points.get((BASELINE, n), [])
        if len(mine) != 2 or len(theirs) != 2:
            found.append(
                Result(
                    f"throughput at concurrency {n}",
                    query,
                    None,
                    None,
                    None,
                    Verdict.INCONCLUSIVE,
                    f"at concurrency {n}, a run has no figures",
                    evidence,
                    kind=Kind.THROUGHPUT,
                )
            )
            continue
        rate, rate_before = fmean(p.throughput for p in mine), fmean(p.throughput for p in theirs)
        floor = rate_before * (1 - spec.perf_throughput_tolerance)
        slower = rate < floor
        found.append(
            Result(
                f"throughput at concurrency {n}",
                query,
                rate,
                rate_before,
                floor,
                Verdict.FAILURE if slower else Verdict.SUCCESS,
                f"at concurrency {n}, the canary served {rate:.1f} requests a second, the "
                f"baseline {rate_before:.1f}: more than {spec.perf_throughput_tolerance:.0%} "
                "fewer"
                if slower
                else "",
                evidence,
                kind=Kind.THROUGHPUT,
            )
        )
        # A run's P99 is its slowest few requests, which one stall on the node lifts: slower
        # only where both of the canary's runs are, against the baseline's slower run.
        p99, p99_before = fmean(p.p99_ms for p in mine), fmean(p.p99_ms for p in theirs)
        worst = max(p.p99_ms for p in theirs)
        ceiling = max(worst * (1 + spec.perf_p99_tolerance), worst + spec.latency_margin_ms)
        best = min(p.p99_ms for p in mine)
        later = best > ceiling
        found.append(
            Result(
                f"P99 at concurrency {n}",
                query,
                p99,
                p99_before,
                ceiling,
                Verdict.FAILURE if later else Verdict.SUCCESS,
                f"at concurrency {n}, the canary's P99 was {best:.1f} ms in its faster run, "
                f"the baseline's {worst:.1f} in its slower: above {ceiling:.1f}"
                if later
                else "",
                evidence,
                kind=Kind.LATENCY,
            )
        )
    return found

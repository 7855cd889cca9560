"""Reads of the rollouts app that more than one caller needs."""

from apps.fleet.models import Deployment, NodePool, Release
from apps.registry.models import Model
from apps.rollouts.models import AnalysisTemplate, Rollout

State = Rollout.State


def template_names() -> list[str]:
    """Every analysis template's name, once, in order."""
    names = AnalysisTemplate.objects.order_by("name").values_list("name", flat=True)
    return list(names.distinct())


def last_good_version(model: Model, pool: NodePool) -> int | None:
    """The newest version the pool ran before its current one; never a canary that was rolled
    back or failed, nor a release on-call rolled back from."""
    return last_good_versions([(model.pk, pool.pk)]).get((model.pk, pool.pk))


def last_good_versions(pairs: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """`last_good_version` of each (model id, pool id) pair, in three queries however many."""
    models, pools = {m for m, _ in pairs}, {p for _, p in pairs}
    current = dict(
        ((d.model_id, d.pool_id), d.version)
        for d in Deployment.objects.filter(model_id__in=models, pool_id__in=pools)
    )
    bad: dict[tuple[int, int], set[int]] = {}
    failed = Rollout.objects.filter(
        model_id__in=models, pool_id__in=pools, state__in=[State.ROLLED_BACK, State.FAILED]
    )
    for model_id, pool_id, version in failed.values_list("model_id", "pool_id", "canary_version"):
        bad.setdefault((model_id, pool_id), set()).add(version)
    releases = list(
        Release.objects.filter(model_id__in=models, pool_id__in=pools)
        .order_by("-started_at", "-id")
        .values_list("model_id", "pool_id", "version", "rolled_back")
    )
    for model_id, pool_id, version, rolled_back in releases:
        if rolled_back:
            bad.setdefault((model_id, pool_id), set()).add(version)
    found: dict[tuple[int, int], int] = {}
    for model_id, pool_id, version, _ in releases:
        pair = (model_id, pool_id)
        if pair in found or version in bad.get(pair, ()) or version == current.get(pair):
            continue
        found[pair] = version
    return {pair: found[pair] for pair in pairs if pair in found}

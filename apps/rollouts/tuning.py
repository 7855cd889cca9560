"""Tuning as a release: an advice of the bottleneck view (apps/observability/bottleneck.py)
accepted becomes a new version of its step whose config differs only in the advised fields, a
new version of the pipeline pinning it, and a rollout of that pipeline version judged on
throughput and the step's queue time as well as latency, canary against baseline.

Triton reads a version's files from its own directory, so both new versions get one in the
nodes' model repository, copied from the versions they are made from: this needs the source
versions' artifacts to be directories this server may read and write (REGISTRY_ARTIFACT_ROOTS),
as the demo's shared repository is."""

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from django.conf import settings

from apps.accounts.permissions import authorize, second_person
from apps.audit.services import Actor, audit_record, audited
from apps.fleet.models import Deployment, NodePool
from apps.observability.bottleneck import Advice
from apps.performance.models import PerfSearch
from apps.prometheus.catalog import tuning_queries
from apps.registry.archives import inside_roots
from apps.registry.codec import from_dict, to_pbtxt, tuned
from apps.registry.models import ModelVersion
from apps.registry.selectors import next_version, registry_resolver
from apps.registry.services import RegistryError, version_create
from apps.rollouts.models import AnalysisTemplate, Rollout
from apps.rollouts.plans import PlanError
from apps.rollouts.proposals import RolloutError, rollout_start

# The canary may serve this share fewer requests a node than the baseline, and queue this share
# longer, before the tuning counts as worse (the queue's is wider: it is the noisier of the two).
THROUGHPUT_TOLERANCE = 0.05
QUEUE_TOLERANCE = 0.25


def tuning_metrics(pipeline: str, step: str) -> list[dict[str, Any]]:
    queries = tuning_queries(pipeline=pipeline, step=step)
    return [
        {
            "name": f"{pipeline} requests/s a node",
            "query": queries["throughput"],
            "higher_is_better": True,
            "tolerance": THROUGHPUT_TOLERANCE,
        },
        {
            "name": f"{step} queue (ms a request)",
            "query": queries["queue"],
            "higher_is_better": False,
            "tolerance": QUEUE_TOLERANCE,
        },
    ]


@audited("rollout.tune", lambda pool_name, **_: f"pool:{pool_name}", (RolloutError, PlanError))
def tuning_start(
    *,
    pipeline: str,
    pool_name: str,
    advice: Advice,
    plan: str,
    actor: Actor,
    template: str = "",
    analysis: dict[str, Any] | None = None,
) -> Rollout:
    """Release `advice` to `pool_name` as a rollout of a new `pipeline` version; nothing is
    kept (no version, no file) when any part of it is refused. On a protected pool the whole
    of it waits for a second person, before anything is made."""
    if not advice.fields:
        raise RolloutError(f"{advice.change!r} changes no config field: it is not a release")
    pool = NodePool.objects.filter(name=pool_name).first()
    deployed = Deployment.objects.filter(pool=pool, node=None, model__name=pipeline).first()
    if pool is None or deployed is None:
        raise RolloutError(f"pool {pool_name} does not run {pipeline}")
    authorize(actor, "registry.add_modelversion", pool)
    asked = {"pipeline": pipeline, "pool": pool_name, "advice": asdict(advice), "plan": plan}
    second_person(actor, pool, "rollout.tune", asked | {"template": template, "analysis": analysis})
    serving = ModelVersion.objects.get(model=deployed.model, version=deployed.version)
    config = from_dict(serving.config)
    pins = [s for s in config.ensemble_scheduling.step if s.model_name == advice.step]
    if not pins:
        raise RolloutError(f"{pipeline} v{serving.version} has no step {advice.step}")
    resolved = registry_resolver()(advice.step, pins[0].model_version)
    if resolved.version is None:
        raise RolloutError(f"{pipeline} v{serving.version}: {resolved.reason}")
    source = ModelVersion.objects.get(model__name=advice.step, version=resolved.version)
    step_number = next_version(advice.step)
    pipeline_number = next_version(pipeline)
    for pin in pins:
        pin.model_version = step_number
    step_config = from_dict(tuned(source.config, advice.fields))
    described = f"{advice.change}, advised because {advice.because}"
    with (
        _copied(source, step_number, step_config) as step_files,
        _copied(serving, pipeline_number, config) as pipeline_files,
    ):
        try:
            # A draft: no pin to the step's latest version takes it up outside this rollout.
            version_create(
                model_name=advice.step,
                config=step_config,
                actor=actor,
                version=step_number,
                artifact=step_files,
                notes=f"Tuning of v{source.version}: {described}.",
            )
            version_create(
                model_name=pipeline,
                config=config,
                actor=actor,
                version=pipeline_number,
                artifact=pipeline_files,
                notes=f"v{serving.version} with {advice.step} v{step_number} (tuning).",
                status=ModelVersion.Status.PUBLISHED,
                resolve=registry_resolver(),
            )
        except RegistryError as exc:
            raise RolloutError(f"the tuned config is refused: {exc}") from None
        metrics = _template_metrics(template) + tuning_metrics(pipeline, advice.step)
        rollout = rollout_start(
            model_name=pipeline,
            pool_name=pool_name,
            canary_version=pipeline_number,
            plan=plan,
            analysis=(analysis or {}) | {"metrics": metrics},
            actor=actor,
            template=template,
        )
    audit_record(
        actor=actor,
        target=f"rollout:{rollout.pk}:{pipeline}",
        after={
            "step": advice.step,
            "from": source.version,
            "to": step_number,
            "pipeline": {"from": serving.version, "to": pipeline_number},
            "change": advice.change,
            "fields": advice.fields,
            "because": advice.because,
            "expect": advice.expect,
        },
    )
    return rollout


@contextmanager
def _copied(source: ModelVersion, number: int, config: Any) -> Iterator[str]:
    """`source`'s version directory copied beside it as version `number`, with `config` in it
    (the repository then agrees with the registry); removed again if what follows fails."""
    name = f"{source.model.name} v{source.version}"
    roots = [Path(root) for root in settings.REGISTRY_ARTIFACT_ROOTS]
    files = Path(source.artifact) if source.artifact else None
    if files is None or not files.is_dir() or not inside_roots(files, roots):
        where = f"at {source.artifact!r}" if source.artifact else "not recorded"
        raise RolloutError(
            f"{name}'s files are {where}, not a directory under REGISTRY_ARTIFACT_ROOTS: its "
            "tuned version cannot be given files; add it to the nodes' repository by hand"
        )
    linked = next((p for p in sorted(files.rglob("*")) if p.is_symlink()), None)
    if linked is not None:
        raise RolloutError(
            f"{name}'s files hold a symbolic link, {linked}: a tuned version copies files, "
            "never what a link points to; replace it by the file"
        )
    target = files.parent / str(number)
    if target.exists():
        raise RolloutError(
            f"{target} exists but {source.model.name} v{number} is not in the registry: import "
            "or remove it first"
        )
    # Copied aside, then renamed into place at once: a request killed while it copies leaves a
    # hidden directory Triton never reads as a version, never half a version.
    staging = files.parent / f".{number}.partial-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(files, staging, ignore=shutil.ignore_patterns("__pycache__"))
        (staging / "config.pbtxt").write_text(to_pbtxt(config))
        staging.rename(target)
        yield str(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
        raise


def _template_metrics(name: str) -> list[dict[str, Any]]:
    """The chosen template's own metrics, kept beside the tuning's."""
    found = AnalysisTemplate.objects.filter(name=name).order_by("-version").first()
    return list(found.analysis.get("metrics", [])) if found else []


def search_advice(search_id: int) -> tuple[PerfSearch, Advice]:
    """A search's winner as an advice to release: refused for a search not done, one whose
    winner is the config it started from, and one of a pipeline version the pool no longer
    serves (what it measured is not what the tuning would change)."""
    search = PerfSearch.objects.select_related("pipeline", "winner").filter(pk=search_id).first()
    if search is None:
        raise RolloutError(f"no search #{search_id}")
    first = search.trials.order_by("id").first()
    winner = search.winner
    if search.status != PerfSearch.Status.DONE or winner is None or first is None:
        raise RolloutError(f"search #{search.pk} is {search.status}: it has no winner yet")
    if winner.pk == first.pk or not (winner.throughput and first.throughput):
        raise RolloutError(f"search #{search.pk} found nothing better than the config it serves")
    serving = Deployment.objects.filter(
        pool__name=search.pool_name, node=None, model=search.pipeline
    ).first()
    if serving is None or serving.version != search.version:
        now = f"v{serving.version}" if serving else "nothing"
        raise RolloutError(
            f"search #{search.pk} measured {search.pipeline.name} v{search.version}; pool "
            f"{search.pool_name} serves {now} now: search again"
        )
    budget = f", within {search.budget_ms} ms" if search.budget_ms else ""
    return search, Advice(
        step=search.step,
        change=winner.label,
        because=(
            f"search #{search.pk} on {search.node_name} measured {winner.throughput:.1f} "
            f"requests a second at P99 {winner.p99_ms:.0f} ms against {first.throughput:.1f} at "
            f"{first.p99_ms:.0f} ms with {first.label}, {search.concurrency} users{budget}"
        ),
        expect=f"{winner.throughput / first.throughput - 1:.0%} more requests a second a node",
        fields=winner.fields,
    )

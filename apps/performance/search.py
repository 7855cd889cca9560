"""A search over one step's config on one node held aside (apps/fleet/trials.py), the pipeline
measured end to end with perf_analyzer at each config: Model Analyzer's quick search, driven by
the product. Model Analyzer profiles a remote Triton only with the config it already serves (its
remote launch mode loads no configs), and a search is loads of configs; here each is a load in
the node's history, read back READY before it is measured.

From the config the step serves: its instance count doubled, then its maximum batch size, then
its batching delay raised, each while the pipeline serves GAIN more requests a second within its
latency budget; the best so far is what the next change starts from. The winner is offered as a
tuning release (apps/rollouts/tuning.py), judged again before and after traffic."""

from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone

from apps.fleet.trials import Aside, TrialError, held_aside
from apps.performance.analyzer import PerfError, SearchError, perf_measure
from apps.performance.models import PerfSearch, PerfTrial
from apps.registry.codec import from_dict, tuned
from apps.registry.ensembles import streams
from apps.registry.models import ModelVersion
from apps.registry.selectors import registry_resolver

GAIN = 0.05  # a change is kept when the pipeline serves this share more
MAX_INSTANCES = 8
MAX_BATCH = 64
DELAYS_US = (1_000, 5_000, 20_000)
TRIAL_TIMEOUT_S = 60  # perf_analyzer's, a trial
# The most trials a search runs: the config served, then at most three of each change.
MOST_TRIALS = 1 + 3 + 3 + len(DELAYS_US)


def search_lost_after() -> timedelta:
    """The longest a search may take, every trial's load and run at their timeouts: one still
    open past it (from its request) lost its worker or its message, and holds nothing."""
    return MOST_TRIALS * timedelta(seconds=TRIAL_TIMEOUT_S + settings.FLEET_LOAD_TIMEOUT_S)


def searches_holding() -> QuerySet[PerfSearch]:
    """The searches that hold a node aside now."""
    since = timezone.now() - search_lost_after()
    return PerfSearch.objects.filter(status__in=PerfSearch.OPEN, created_at__gt=since)


def search_execute(*, search_id: int) -> None:
    """Run the search; claimed by a conditional update, so one delivered twice runs once."""
    claimed = PerfSearch.objects.filter(pk=search_id, status=PerfSearch.Status.QUEUED)
    if claimed.update(status=PerfSearch.Status.RUNNING) != 1:
        return
    search = PerfSearch.objects.select_related("pipeline", "node__pool").get(pk=search_id)
    try:
        if search.node is None:
            raise SearchError(f"{search.node_name} was removed")
        with held_aside(search.node, search.step, f"search #{search.pk}") as aside:
            _search(search, aside)
    except (SearchError, TrialError) as exc:
        return search_failed(search_id=search_id, error=str(exc))
    PerfSearch.objects.filter(pk=search_id).update(
        status=PerfSearch.Status.DONE, finished_at=timezone.now()
    )


def search_failed(*, search_id: int, error: str) -> None:
    PerfSearch.objects.filter(pk=search_id, status__in=PerfSearch.OPEN).update(
        status=PerfSearch.Status.FAILED, error=error, finished_at=timezone.now()
    )


def _search(search: PerfSearch, aside: Aside) -> None:
    config, measure = aside.base.config or {}, _measurer(search)
    best = _trial(search, aside, measure, config, {})
    if best.throughput is None:
        raise SearchError(f"the config {search.step} serves could not be measured: {best.error}")
    for change in (_instances, _batch, _delay):
        for fields in change(tuned(config, best.fields)):
            trial = _trial(search, aside, measure, config, best.fields | fields)
            if not better(trial, best, search.budget_ms):
                break
            best = trial
    PerfSearch.objects.filter(pk=search.pk).update(winner=best)


def better(trial: PerfTrial, best: PerfTrial, budget_ms: int | None) -> bool:
    """Within the budget where the best is not; else GAIN more requests a second, within it."""
    if trial.throughput is None or trial.p99_ms is None or best.throughput is None:
        return False
    inside = budget_ms is None or trial.p99_ms <= budget_ms
    if best.p99_ms is not None and budget_ms is not None and best.p99_ms > budget_ms:
        return inside
    return inside and trial.throughput > best.throughput * (1 + GAIN)


def _instances(config: dict[str, Any]) -> list[dict[str, Any]]:
    count = int((config.get("instance_group") or [{}])[0].get("count", 1))
    doubled = [count * 2**n for n in range(1, 4) if count * 2**n <= MAX_INSTANCES]
    return [{"instance_group": [{"count": n}]} for n in doubled]


def _batch(config: dict[str, Any]) -> list[dict[str, Any]]:
    size = int(config.get("max_batch_size", 0))
    doubled = [size * 2**n for n in range(1, 4) if 0 < size * 2**n <= MAX_BATCH]
    return [{"max_batch_size": n} for n in doubled]


def _delay(config: dict[str, Any]) -> list[dict[str, Any]]:
    if "dynamic_batching" not in config:
        return []
    now = int(config["dynamic_batching"].get("max_queue_delay_microseconds", 0))
    return [
        {"dynamic_batching": {"max_queue_delay_microseconds": str(us)}}
        for us in DELAYS_US
        if us > now
    ]


def label(config: dict[str, Any]) -> str:
    """A step's config in the words of a search: its instances, batch and batching delay."""
    count = int((config.get("instance_group") or [{}])[0].get("count", 1))
    words = [f"{count} instance{'s' if count != 1 else ''}"]
    if size := int(config.get("max_batch_size", 0)):
        words.append(f"batch {size}")
    if "dynamic_batching" in config:
        delay = config["dynamic_batching"].get("max_queue_delay_microseconds", 0)
        words.append(f"delay {int(delay):,} us")
    return ", ".join(words)


def _trial(
    search: PerfSearch,
    aside: Aside,
    measure: Callable[[], list[Any]],
    config: dict[str, Any],
    fields: dict[str, Any],
) -> PerfTrial:
    """The step loaded with `fields` over `config` and the pipeline measured; stored."""
    trial = PerfTrial(search=search, fields=fields, label=label(tuned(config, fields)))
    trial.error = aside.load(fields)
    if not trial.error:
        try:
            (point,) = measure()
        except PerfError as exc:
            trial.error = str(exc)
        else:
            trial.throughput, trial.p99_ms = point.throughput, point.p99_ms
            trial.queue_us, trial.compute_us = point.queue_us, point.compute_us
    trial.save()
    return trial


def _measurer(search: PerfSearch) -> Callable[[], list[Any]]:
    """perf_analyzer's run of the pipeline on the search's node, as every trial measures it."""
    node, pipeline = search.node, search.pipeline
    if node is None:
        raise SearchError(f"{search.node_name} was removed")
    config = ModelVersion.objects.get(model=pipeline, version=search.version).config
    return partial(
        perf_measure,
        grpc_url=node.grpc_url,
        model=pipeline.name,
        version=search.version,
        concurrencies=(search.concurrency, search.concurrency, 1),
        requests=search.requests,
        node=node.name,
        inputs=pipeline.sample_inputs,
        batched=bool(config.get("max_batch_size", 0)),
        streaming=streams(from_dict(config), registry_resolver()),
        timeout_s=TRIAL_TIMEOUT_S,
    )

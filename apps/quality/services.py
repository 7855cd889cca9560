"""Evaluation sets in, evaluation runs out: every write here, each audited."""

from collections.abc import Iterable

from django.db import transaction

from apps.accounts.permissions import authorize
from apps.audit.services import Actor, actor_name, audit_record, audited
from apps.fleet.models import Node
from apps.fleet.selectors import observed_many
from apps.fleet.tasks import send_to
from apps.fleet.triton import tensors_json
from apps.quality.cases import Case, Signature, parse_cases
from apps.quality.errors import QualityError
from apps.quality.models import EvaluationCase, EvaluationRun, EvaluationSet, SyntheticLoad
from apps.quality.runner import request
from apps.quality.selectors import latest_set, reference_version
from apps.quality.tasks import drive_load, run_evaluation
from apps.registry.models import Model


def _model_target(*, model_name: str, **_: object) -> str:
    return f"model:{model_name}"


@audited("evaluation_set.import", _model_target, (QualityError,))
def evaluation_set_import(
    *, model_name: str, name: str, text: str | Iterable[bytes], actor: Actor, source: str = ""
) -> EvaluationSet:
    """The cases of a JSON Lines text (or a file's lines, read as they come) as the set's next
    version, checked against the model's config (tensor names, types, dims) and each rule; a
    single problem refuses the whole set."""
    authorize(actor, "quality.add_evaluationset", None)
    model = Model.objects.select_for_update().filter(name=model_name).first()
    if model is None:
        raise QualityError(f"no model named {model_name!r} in the registry")
    if not name or len(name) > 60 or not all(c.isalnum() or c in "-_" for c in name):
        raise QualityError(f"{name!r} is not a set's name: letters, digits, - and _")
    reference = reference_version(model)
    if reference is None:
        raise QualityError(f"{model_name} has no version to check the cases against")
    lines = text.split("\n") if isinstance(text, str) else text
    cases, problems = parse_cases(lines, Signature.of(reference.config))
    if problems:
        raise QualityError(problems)
    signature = Signature.of(reference.config)
    samples = [tensors_json(request(c.inputs, signature)) for c in cases[:SAMPLE_CASES]]
    if samples != model.sample_inputs:  # the newest set's: what warm-ups and probes send
        Model.objects.filter(pk=model.pk).update(sample_inputs=samples)
    latest = latest_set(model_id=model.pk, name=name)
    if latest is not None and _same(latest, cases):
        return latest  # imported again unchanged (each `make demo`): no new version, no event
    found = EvaluationSet.objects.create(
        model=model,
        name=name,
        version=latest.version + 1 if latest else 1,
        source=source[:200],
        created_by=actor_name(actor),
    )
    EvaluationCase.objects.bulk_create(
        EvaluationCase(
            evaluation_set=found, line=c.line, name=c.name, inputs=c.inputs, expect=c.expect
        )
        for c in cases
    )
    audit_record(
        actor=actor,
        target=f"model:{model_name}",
        after={
            "set": name,
            "version": found.version,
            "cases": len(cases),
            "checked_against": reference.version,
            "source": source,
        },
    )
    return found


# A model's sample inputs: the first cases of its newest set, sent by warm-ups and probes.
SAMPLE_CASES = 20


def _same(found: EvaluationSet, cases: list[Case]) -> bool:
    stored = found.cases.values_list("line", "name", "inputs", "expect")
    return list(stored) == [(c.line, c.name, c.inputs, c.expect) for c in cases]


def _run_target(*, set_id: int, **_: object) -> str:
    found = EvaluationSet.objects.filter(pk=set_id).select_related("model").first()
    return f"model:{found.model.name}" if found else f"evaluation_set:{set_id}"


@audited("evaluation.start", _run_target, (QualityError,))
def evaluation_start(
    *,
    set_id: int,
    version: int,
    actor: Actor,
    baseline_version: int | None = None,
    node: Node | None = None,
    baseline_node: Node | None = None,
    concurrency: int = 4,
    timeout_s: float = 10.0,
    purpose: str = "",
) -> EvaluationRun:
    """Queue a run of the set against `version` (and `baseline_version`, case by case), each on
    the node given or on a node that has it READY. The worker sends the cases once this commits."""
    found = EvaluationSet.objects.filter(pk=set_id).select_related("model").first()
    if found is None:
        raise QualityError(f"no evaluation set #{set_id}")
    wanted = {version} | ({baseline_version} if baseline_version else set())
    known = set(found.model.versions.filter(version__in=wanted).values_list("version", flat=True))
    if missing := sorted(wanted - known):
        raise QualityError(f"{found.model.name} has no version {missing[0]} in the registry")
    if not 1 <= concurrency <= 64 or not 0 < timeout_s <= 600:
        raise QualityError("concurrency is 1 to 64 and the timeout 0 to 600 s per case")
    node = node or _serving(found.model.name, version)
    if baseline_version:
        baseline_node = baseline_node or _serving(found.model.name, baseline_version)
    for where in {node.pool, *([baseline_node.pool] if baseline_node else [])}:
        authorize(actor, "quality.add_evaluationrun", where)
    run = EvaluationRun.objects.create(
        evaluation_set=found,
        version=version,
        baseline_version=baseline_version,
        node=node,
        baseline_node=baseline_node,
        concurrency=concurrency,
        timeout_s=timeout_s,
        purpose=purpose[:200],
        requested_by=actor_name(actor),
    )
    audit_record(
        actor=actor,
        target=f"model:{found.model.name}",
        after={
            "run": run.pk,
            "set": f"{found.name} v{found.version}",
            "version": version,
            "baseline": baseline_version,
            "node": node.name,
            "purpose": purpose,
        },
    )
    queue = node.pool.queue if node.pool_id else ""
    # Robust: with the broker away the run stays queued, and says so on its page.
    transaction.on_commit(lambda: send_to(queue, run_evaluation, run.pk), robust=True)
    return run


def _serving(model: str, version: int) -> Node:
    """A reachable node that has the version READY, by its last reading."""
    nodes = list(Node.objects.exclude(health=Node.Health.UNREACHABLE).order_by("name"))
    readings = observed_many(nodes, [model])
    for node in nodes:
        if version in readings[(node.pk, model)][0]:
            return node
    raise QualityError(f"no reachable node has {model} v{version} READY")


def _load_target(*, set_id: int, nodes: list[Node], **_: object) -> str:
    """The pool's and the model's, as a deployment's: charts of either show the load."""
    pool = nodes[0].pool.name if nodes and nodes[0].pool_id else ""
    return _run_target(set_id=set_id).replace("model:", f"pool:{pool}:" if pool else "model:", 1)


@audited("synthetic_load.start", _load_target, (QualityError,))
def synthetic_load_start(
    *,
    set_id: int,
    nodes: list[Node],
    rps: float,
    seconds: int,
    actor: Actor,
    purpose: str = "",
) -> SyntheticLoad:
    """Send the set's inputs, unversioned, round-robin to `nodes` at `rps` for `seconds`: each
    node answers with what it serves. Requests a judge needs where users send too few."""
    found = EvaluationSet.objects.filter(pk=set_id).select_related("model").first()
    if found is None:
        raise QualityError(f"no evaluation set #{set_id}")
    if not nodes or not 0 < rps <= 100 or not 1 <= seconds <= 3600:
        raise QualityError("a load goes to 1 node at least, at 0 to 100 rps, for 1 s to 1 h")
    for where in {node.pool for node in nodes}:
        authorize(actor, "quality.add_evaluationrun", where)
    load = SyntheticLoad.objects.create(
        evaluation_set=found,
        nodes=[node.name for node in nodes],
        rps=rps,
        seconds=seconds,
        purpose=purpose[:200],
        requested_by=actor_name(actor),
    )
    audit_record(
        actor=actor,
        target=_load_target(set_id=set_id, nodes=nodes),
        after={
            "load": load.pk,
            "set": f"{found.name} v{found.version}",
            "nodes": load.nodes,
            "rps": rps,
            "seconds": seconds,
        },
        message=purpose,
    )
    queue = nodes[0].pool.queue if nodes[0].pool_id else ""
    transaction.on_commit(lambda: send_to(queue, drive_load, load.pk), robust=True)
    return load

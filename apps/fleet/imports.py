"""Import what a live node runs into the registry: its repository index and each model's config."""

from apps.audit.services import Actor
from apps.fleet.models import Node
from apps.fleet.triton import TritonClient, ready_in
from apps.registry.codec import from_dict, without_version_policy
from apps.registry.imports import Candidate, ImportResult, candidates_import


def node_import(*, node: Node, actor: Actor, dry_run: bool = False) -> list[ImportResult]:
    client = TritonClient.of(node)
    candidates = []
    for model, ready in sorted(ready_in(client.repository_index()).items()):
        numbers = sorted(ready)
        # Triton keeps one config per model; every loaded version runs with it. Fields newer than
        # our schema (a newer server) are dropped rather than refused.
        config = without_version_policy(
            from_dict(client.model_config(model), ignore_unknown_fields=True)
        )
        candidates.append(
            Candidate(
                name=model,
                configs={v: config for v in numbers},
                artifacts={v: f"{node.name}:{model}/{v}" for v in numbers},
            )
        )
    return candidates_import(candidates=candidates, actor=actor, dry_run=dry_run)

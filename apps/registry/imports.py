"""Import whole model repositories (a directory, or what a live node reports) into the registry.

All models are validated together, each after the models of the import its ensembles use (as Triton
orders its dependency graph): an ensemble may use any model of the same import, ensembles included,
or one already registered. Valid models are stored as published versions; invalid ones are reported,
never stored.
"""

import graphlib
import hashlib
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from django.core.files import File
from django.db import transaction

from apps.audit.services import Actor, audit_record, audited
from apps.registry.archives import MAX_UPLOAD_BYTES, ArchiveError, extract_repository
from apps.registry.codec import ConfigSyntaxError, to_dict
from apps.registry.models import ModelVersion
from apps.registry.repository import read_model
from apps.registry.selectors import registry_resolver
from apps.registry.services import RegistryError, config_problems, version_create
from apps.registry.validation import Problem, errors


@dataclass
class ImportResult:
    model: str
    versions: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    imported: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "versions": self.versions,
            "ok": self.ok,
            "errors": self.errors,
        }


@dataclass(frozen=True)
class Candidate:
    """One model to import: its configs per version and where each version's files are."""

    name: str
    configs: dict[int, Any]
    artifacts: dict[int, str]
    checksums: dict[int, str] = field(default_factory=dict)


def read_candidates(repository: Path) -> tuple[list[Candidate], list[ImportResult]]:
    """Every model directory of a repository, or the reason it cannot be read."""
    candidates, failures = [], []
    for entry in sorted(
        p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")
    ):
        if not (entry / "config.pbtxt").is_file():
            failures.append(ImportResult(entry.name, errors=[f"{entry}/config.pbtxt: missing"]))
            continue
        try:
            model = read_model(repository, entry.name)
        except ConfigSyntaxError as exc:
            failures.append(ImportResult(entry.name, errors=[str(exc)]))
            continue
        except UnicodeDecodeError as exc:
            failures.append(
                ImportResult(entry.name, errors=[f"{entry}/config.pbtxt: not UTF-8 ({exc})"])
            )
            continue
        if not model.versions:
            failures.append(
                ImportResult(entry.name, errors=[f"{entry}: no numeric version directory"])
            )
            continue
        candidates.append(
            Candidate(
                name=model.name,
                configs=model.configs,
                artifacts={v: str(entry / str(v)) for v in model.versions},
                checksums={v: _checksum(entry / str(v)) for v in model.versions},
            )
        )
    return candidates, failures


def _checksum(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(
        p for p in directory.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    ):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return f"sha256:{digest.hexdigest()}"


@audited("registry.import", lambda **_: "registry")
def candidates_import(
    *, candidates: list[Candidate], actor: Actor, dry_run: bool = False
) -> list[ImportResult]:
    """Validate all together, then store the valid ones (steps before their ensembles): one
    action, whose event lists every version it registered."""
    results = {c.name: ImportResult(c.name, versions=sorted(c.configs)) for c in candidates}
    valid: dict[str, dict[int, Any]] = {}
    # Steps first, so that ensembles only resolve steps that are themselves valid.
    ordered, cycles = _dependency_order(candidates)
    for candidate in ordered:
        if candidate.name in cycles:
            cycle = Problem("error", candidate.name, "ensemble_scheduling", cycles[candidate.name])
            results[candidate.name].errors.append(str(cycle))
            continue
        resolve = registry_resolver(valid)
        for version, config in sorted(candidate.configs.items()):
            problems = errors(
                config_problems(config, expected_name=candidate.name, resolve=resolve)
            )
            results[candidate.name].errors += [f"v{version}: {p}" for p in problems]
        if results[candidate.name].ok:
            valid[candidate.name] = candidate.configs
    if not dry_run:
        with transaction.atomic():
            for candidate in ordered:
                if candidate.name in valid:
                    _store(candidate, results[candidate.name], actor=actor, resolve_with=valid)
        imported = {name: result.imported for name, result in results.items() if result.imported}
        if imported:
            audit_record(actor=actor, target="registry", after=imported)
    return [results[c.name] for c in candidates]


def _dependency_order(candidates: list[Candidate]) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates, each after the candidates its ensembles use, and for each member of a cycle
    of ensembles the cycle from it ("ensemble cycle: a -> b -> a"): Triton refuses all of them."""
    by_name = {c.name: c for c in candidates}
    uses = {
        c.name: {s.model_name for x in c.configs.values() for s in x.ensemble_scheduling.step}
        & by_name.keys()
        for c in candidates
    }
    cycles: dict[str, str] = {}
    while True:
        try:
            order = list(graphlib.TopologicalSorter(uses).static_order())
        except graphlib.CycleError as exc:
            cycle = exc.args[1][:0:-1]  # graphlib lists it from the used model to its user
            for i, name in enumerate(cycle):
                cycles[name] = "ensemble cycle: " + " -> ".join([*cycle[i:], *cycle[:i], name])
            uses = {n: used - cycles.keys() for n, used in uses.items()}
            continue
        return [by_name[name] for name in order], cycles


def _store(
    candidate: Candidate,
    result: ImportResult,
    *,
    actor: Actor,
    resolve_with: dict[str, dict[int, Any]],
) -> None:
    existing = {
        v.version: v.config for v in ModelVersion.objects.filter(model__name=candidate.name)
    }
    for version, config in sorted(candidate.configs.items()):
        if version in existing:
            if existing[version] != to_dict(config):
                result.errors.append(f"v{version}: already registered with a different config")
            continue  # re-importing the same repository changes nothing
        try:
            version_create(
                model_name=candidate.name,
                config=config,
                version=version,
                actor=actor,
                artifact=candidate.artifacts.get(version, ""),
                checksum=candidate.checksums.get(version, ""),
                status=ModelVersion.Status.PUBLISHED,
                resolve=registry_resolver(resolve_with),
            )
        except RegistryError as exc:
            result.errors += [f"v{version}: {p}" for p in exc.problems]
            continue
        result.imported.append(version)


def archive_import(*, archive: File, actor: Actor, dry_run: bool = False) -> list[ImportResult]:
    """A repository uploaded as a zip: unpacked in a temporary directory, imported without its
    files (they are gone after the request), removed. Raises ArchiveError."""
    if archive.size is None or archive.size > MAX_UPLOAD_BYTES:
        raise ArchiveError(f"the archive is larger than {MAX_UPLOAD_BYTES // 2**20} MiB")
    with tempfile.TemporaryDirectory() as tmp:
        root = extract_repository(archive.read(), Path(tmp))
        results = repository_import(path=root, actor=actor, dry_run=dry_run, artifacts=False)
        # Where a mistake is, said as a path inside the archive, not where it was unpacked.
        unpacked = f"{Path(tmp).resolve()}/"
    return [replace(r, errors=[e.replace(unpacked, "") for e in r.errors]) for r in results]


def repository_import(
    *, path: Path, actor: Actor, dry_run: bool = False, artifacts: bool = True
) -> list[ImportResult]:
    path = path.resolve()
    if not path.is_dir():
        return [ImportResult(path.name, errors=[f"{path}: not a directory"])]
    candidates, failures = read_candidates(path)
    if not artifacts:
        candidates = [replace(c, artifacts={}) for c in candidates]
    return sorted(
        candidates_import(candidates=candidates, actor=actor, dry_run=dry_run) + failures,
        key=lambda r: r.model,
    )

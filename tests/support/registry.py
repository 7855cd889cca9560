from apps.registry.imports import repository_import
from tests.support import REPOSITORY


def import_demo() -> None:
    results = repository_import(path=REPOSITORY, actor="system:test")
    assert all(r.ok for r in results), [r.errors for r in results]

"""PRODUCTION=true: Django's deployment checklist passes, and the demo's zero-setup defaults
(SQLite, a Redis assumed on localhost) are errors that say what to set."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parents[2]
PRODUCTION = {
    "PRODUCTION": "true",
    "SECRET_KEY": "a-production-secret-key-of-fifty-or-more-characters-and-variety-7Qz",
    "DATABASE_URL": "postgres://controlplane@db.internal:5432/controlplane",
    "CELERY_BROKER_URL": "redis://redis.internal:6379/0",
    "ALLOWED_HOSTS": "controlplane.example.com",
}


def check(**changes: str | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"]}  # nothing of the test run's own settings
    env |= {k: v for k, v in (PRODUCTION | changes).items() if v is not None}
    argv = [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)


def test_the_deployment_checklist_passes_in_production() -> None:
    result = check()
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"DATABASE_URL": None}, "PRODUCTION=true needs PostgreSQL: set DATABASE_URL=postgres://"),
        ({"DATABASE_URL": "sqlite:///var/x.sqlite3"}, "PRODUCTION=true needs PostgreSQL"),
        ({"CELERY_BROKER_URL": None}, "PRODUCTION=true needs Redis named explicitly"),
        ({"DEBUG": "true"}, "PRODUCTION=true with DEBUG=true"),
        ({"SECURE_SSL_REDIRECT": "false"}, "security.W008"),
    ],
)
def test_what_production_refuses(changes: dict[str, str | None], message: str) -> None:
    result = check(**changes)
    assert result.returncode != 0
    assert message in result.stderr


def test_settings_refuse_to_start_without_a_secret_key_in_production() -> None:
    env = {
        "PATH": "/usr/bin:/bin",
        "DEBUG": "false",
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    }
    result = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr

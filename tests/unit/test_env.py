from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.env import database_from_url, env_bool, env_header, env_networks, env_url


def test_sqlite_url_relative_to_the_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "sqlite:///var/db.sqlite3")
    db = database_from_url("DATABASE_URL", "", Path("/srv/app"))
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == "/srv/app/var/db.sqlite3"


def test_postgres_url_is_split_into_django_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgres://cp:s%40cret@db.internal:6432/controlplane")
    db = database_from_url("DATABASE_URL", "", Path("/srv/app"))
    assert (db["ENGINE"], db["NAME"], db["USER"], db["PASSWORD"], db["HOST"], db["PORT"]) == (
        "django.db.backends.postgresql",
        "controlplane",
        "cp",
        "s@cret",
        "db.internal",
        "6432",
    )


@pytest.mark.parametrize(
    "url",
    ["mysql://root@localhost/db", "postgres://localhost", "sqlite://", "postgres://h:99999x/d"],
)
def test_bad_database_url_names_the_variable(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        database_from_url("DATABASE_URL", "", Path("/srv/app"))


def test_bad_boolean_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEBUG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="DEBUG='maybe'"):
        env_bool("DEBUG", False)


def test_broker_must_be_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "amqp://guest@localhost//")
    with pytest.raises(ImproperlyConfigured, match="CELERY_BROKER_URL"):
        env_url("CELERY_BROKER_URL", "", ("redis", "rediss"))


def test_networks_and_headers_are_checked_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETS", "10.0.0.0/8, fd00::/8")
    assert env_networks("NETS", []) == ["10.0.0.0/8", "fd00::/8"]
    monkeypatch.setenv("NETS", "10.0.0.0/33")
    with pytest.raises(ImproperlyConfigured, match=r"'10\.0\.0\.0/33' is not a CIDR range"):
        env_networks("NETS", [])
    monkeypatch.setenv("HEADER", "admin-key: s3cret")
    assert env_header("HEADER") == {"admin-key": "s3cret"}
    monkeypatch.setenv("HEADER", "s3cret")
    with pytest.raises(ImproperlyConfigured, match="HEADER must read 'Header-Name: value'"):
        env_header("HEADER")
    monkeypatch.delenv("HEADER")
    assert env_header("HEADER") == {}

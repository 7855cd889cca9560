import os

# Test settings come from the environment like everything else; only what the tests need is set.
os.environ.setdefault("SECRET_KEY", "tests-only-secret-key-that-is-long-enough-for-django-checks")
os.environ.setdefault("SECURE_COOKIES", "false")

import os

import pytest
from django.contrib.auth.models import User

from apps.accounts.roles import Role
from tests.support.users import make_user

# Real Triton nodes, Prometheus, Redis and Celery: for integration, browser and benchmark tests.
pytest_plugins = ["tests.support.services_fixtures"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: object) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # type: ignore[attr-defined]


@pytest.fixture
def viewer(db: None) -> User:
    return make_user(Role.VIEWER)


@pytest.fixture
def operator(db: None) -> User:
    return make_user(Role.OPERATOR)


@pytest.fixture
def admin_user(db: None) -> User:
    return make_user(Role.ADMIN)

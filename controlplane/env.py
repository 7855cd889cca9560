"""Typed readers for environment variables: a bad value stops start-up with the variable's name."""

import os
from ipaddress import ip_network
from pathlib import Path
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean; use true or false.")


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number.") from None
    if value <= 0:
        raise ImproperlyConfigured(f"{name}={raw!r} must be positive.")
    return value


def env_int(name: str, default: int) -> int:
    """A count: zero or more."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not (raw.strip().isascii() and raw.strip().isdigit()):
        raise ImproperlyConfigured(f"{name}={raw!r} is not a whole number (0 or more).")
    return int(raw)


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str, default: list[str]) -> list[str]:
    """CIDR ranges, checked now: a typo must not silently allow or refuse every node."""
    networks = env_list(name, default)
    for network in networks:
        try:
            ip_network(network, strict=False)
        except ValueError:
            raise ImproperlyConfigured(f"{name}: {network!r} is not a CIDR range.") from None
    return networks


def env_header(name: str) -> dict[str, str]:
    """`Name: value` as a one-entry dict for a request's headers, {} when unset."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return {}
    key, sep, value = raw.partition(":")
    if not sep or not key.strip() or not value.strip() or not key.strip().isascii():
        raise ImproperlyConfigured(f"{name} must read 'Header-Name: value'.")
    return {key.strip(): value.strip()}


def env_url(name: str, default: str, schemes: tuple[str, ...]) -> str:
    raw = os.environ.get(name, default)
    parts = urlsplit(raw)
    if parts.scheme not in schemes or not (parts.hostname or parts.path):
        raise ImproperlyConfigured(
            f"{name}={raw!r} is not a valid URL; expected one of {', '.join(schemes)}://..."
        )
    return raw


def database_from_url(name: str, default: str, base_dir: Path) -> dict[str, object]:
    """Django DATABASES entry from `sqlite:///relative/or//absolute` or `postgres://user@host/db`."""
    raw = os.environ.get(name, default)
    parts = urlsplit(raw)
    if parts.scheme == "sqlite":
        path = Path(unquote(parts.path).removeprefix("/"))
        if not path.name:
            raise ImproperlyConfigured(f"{name}={raw!r} names no SQLite file.")
        path = path if path.is_absolute() else base_dir / path
        path.parent.mkdir(parents=True, exist_ok=True)  # var/ does not exist in a fresh clone
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(path),
            "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
            "TEST": {"NAME": str(path.with_name(f"test_{path.name}"))},
        }
    if parts.scheme in {"postgres", "postgresql"}:
        database = unquote(parts.path.removeprefix("/"))
        if not database:
            raise ImproperlyConfigured(f"{name}={raw!r} names no database.")
        try:
            port = parts.port
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}={raw!r} has an invalid port.") from exc
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(port or ""),
            "CONN_MAX_AGE": 60,
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfigured(
        f"{name}={raw!r} is not supported; use sqlite:///path or postgres://user@host:port/db."
    )

"""The only module that talks to Prometheus. Every call has a timeout; failures become
`PrometheusUnavailable` with a message fit for the page."""

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
from django.conf import settings
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry


class PrometheusUnavailable(Exception):
    pass


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    times: list[
        float
    ]  # Unix seconds: converting each point to a datetime costs more than the query
    values: list[float | None]  # None where the value is NaN or infinite: a gap in the line


def escape_label(value: str) -> str:
    """A PromQL double-quoted label value: user text never escapes its quotes."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _connect() -> PrometheusConnect:
    return _connection(
        settings.PROMETHEUS_URL, settings.PROMETHEUS_TIMEOUT_S, settings.PROMETHEUS_CA_BUNDLE
    )


@functools.cache
def _connection(url: str, timeout: int, ca_bundle: str) -> PrometheusConnect:
    """One client (and HTTP keep-alive session) per Prometheus and process. One quick retry at
    most: a page waits on this, and the next refresh tries again anyway. Certificates are
    checked, against `ca_bundle` when one is set, else the system's authorities."""
    client = PrometheusConnect(url=url, retry=Retry(total=1, backoff_factor=0.1), timeout=timeout)
    client._session.verify = ca_bundle or True
    # Prometheus is reached directly: reading the proxy variables on every request cost more
    # than building the chart (tests/bench).
    client._session.trust_env = False
    return client


def shown_url(url: str) -> str:
    """The URL as errors show it: no user, password or query string (a token may hide there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    return urlunsplit(
        (parts.scheme, netloc + (f":{parts.port}" if parts.port else ""), parts.path, "", "")
    )


def _call(method: str, *args: Any, **kwargs: Any) -> Any:
    where = shown_url(settings.PROMETHEUS_URL)
    try:
        return getattr(_connect(), method)(*args, **kwargs)
    except requests.RequestException as exc:
        if isinstance(exc, requests.Timeout):
            reason = f"no answer within {settings.PROMETHEUS_TIMEOUT_S:g} s"
        elif isinstance(exc, requests.exceptions.SSLError):
            reason = "its TLS certificate is not trusted (PROMETHEUS_CA_BUNDLE names a CA file)"
        else:
            reason = "connection failed"
        raise PrometheusUnavailable(f"Prometheus at {where} did not answer: {reason}.") from exc
    except PrometheusApiClientException as exc:
        raise PrometheusUnavailable(f"Prometheus at {where} refused the query: {exc}") from exc


def instant_query(query: str) -> list[tuple[dict[str, str], float]]:
    """The query's value now: (labels, value) per series."""
    return [(row["metric"], float(row["value"][1])) for row in _call("custom_query", query)]


def active_targets(scrape_pool: str) -> list[dict[str, Any]]:
    """The targets Prometheus scrapes now in `scrape_pool` (its targets API's activeTargets)."""
    found = _call("get_targets", state="active", scrape_pool=scrape_pool)
    return list(found.get("activeTargets") or [])


# How Prometheus writes the values a line cannot draw. Matching the text is several times
# cheaper than parsing and testing every point, and a 6 h chart has thousands.
NOT_FINITE = frozenset({"NaN", "+Inf", "-Inf"})


def range_query(query: str, *, start: datetime, end: datetime, step_s: int) -> list[Series]:
    result = _call("custom_query_range", query, start, end, step=f"{step_s}s")
    return [
        Series(
            labels=row["metric"],
            times=[t for t, _ in row["values"]],
            values=[None if v in NOT_FINITE else float(v) for _, v in row["values"]],
        )
        for row in result
    ]

"""A node's own /metrics text (Triton's Prometheus exposition), read with its address pinned
and its size capped, and the figures the fleet takes from it without Prometheus: each GPU's
memory, the host's memory in use."""

import http.client
import re
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from apps.fleet import addresses
from apps.fleet.triton import TritonRejected, TritonUnreachable

# A node's /metrics is a few hundred KiB even with many models; more is not Triton's.
METRICS_MAX_BYTES = 8 * 2**20


_GPU_METRIC = re.compile(
    r'^nv_gpu_memory_(total|used)_bytes\{[^}]*gpu_uuid="(?P<uuid>[^"]+)"[^}]*\}\s+(?P<value>\S+)',
    re.M,
)


def parse_gpu_memory(metrics_text: str) -> list[dict[str, Any]]:
    """GPUs from Triton's /metrics text: uuid, total and used bytes. A CPU node has none."""
    gpus: dict[str, dict[str, Any]] = {}
    for match in _GPU_METRIC.finditer(metrics_text):
        gpu = gpus.setdefault(match["uuid"], {"uuid": match["uuid"], "total": 0.0, "used": 0.0})
        gpu[match.group(1)] = float(match["value"])
    return list(gpus.values())


_CPU_METRIC = re.compile(r"^nv_cpu_memory_(used)_bytes(?:\{[^}]*\})?\s+(?P<value>\S+)", re.M)


def parse_cpu_memory_used(metrics_text: str) -> float | None:
    """The host memory in use (bytes) from Triton's /metrics text; None if it is not there."""
    found = _CPU_METRIC.search(metrics_text)
    return float(found["value"]) if found else None


class _PinnedHTTP(http.client.HTTPConnection):
    """A connection to a checked address, speaking to the host named in the URL."""

    def __init__(self, host: str, port: int | None, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(
        self, host: str, port: int | None, address: str, timeout: float, context: ssl.SSLContext
    ) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self.address = address

    def connect(self) -> None:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)  # type: ignore[attr-defined]


def read_metrics(metrics_url: str, *, node: str, timeout: float = 5.0) -> str:
    """The node's /metrics text, read from the address that was checked, at most
    METRICS_MAX_BYTES of it. A redirect is an error, not a new address."""
    parts = urlsplit(metrics_url)
    host = parts.hostname or ""
    try:
        address = addresses.pinned(host)
    except addresses.Refused as exc:
        raise TritonRejected(node, f"metrics at {metrics_url}: {exc}") from None
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=settings.TRITON_CA_BUNDLE or None)
            conn: http.client.HTTPConnection = _PinnedHTTPS(
                host, parts.port, address, timeout, context
            )
        else:
            conn = _PinnedHTTP(host, parts.port, address, timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            if response.status != 200:
                raise TritonUnreachable(
                    node,
                    f"metrics at {metrics_url}: HTTP Error {response.status}: {response.reason}",
                )
            return _read_capped(response, node=node, url=metrics_url).decode()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as exc:
        raise TritonUnreachable(node, f"metrics at {metrics_url}: {exc}") from exc


def _read_capped(response: http.client.HTTPResponse, *, node: str, url: str) -> bytes:
    """The body, read a chunk at a time and refused as soon as it passes METRICS_MAX_BYTES
    (announced or not): a node's answer must not fill the worker's memory."""
    limit = METRICS_MAX_BYTES
    too_big = f"metrics at {url}: larger than {limit // 2**20} MiB, refused"
    announced = response.getheader("Content-Length")
    if announced and announced.isdigit() and int(announced) > limit:
        raise TritonRejected(node, too_big)
    chunks, size = [], 0
    while chunk := response.read(65536):
        size += len(chunk)
        if size > limit:
            raise TritonRejected(node, too_big)
        chunks.append(chunk)
    return b"".join(chunks)

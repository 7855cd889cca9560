"""Connections to nodes and Prometheus, against real local servers: certificates are checked
(a self-signed one is refused until its CA bundle is set), credentials in the URL are sent, and
a node's redirect is not followed; a node is contacted at the address that was checked, its
metrics read up to a cap, and its name never becomes a second command to HAProxy."""

import base64
import socketserver
import ssl
import subprocess
import threading
from collections.abc import Iterator
from contextlib import suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import gevent.socket
import pytest

from apps.fleet import addresses
from apps.fleet.node_metrics import METRICS_MAX_BYTES, read_metrics
from apps.fleet.traffic.haproxy import HAProxyError, Runtime
from apps.fleet.triton import TritonClient, TritonRejected, TritonUnreachable
from apps.prometheus.client import PrometheusUnavailable, instant_query

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tls_prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """An https server answering Prometheus' query API (empty results) with a self-signed
    certificate for 127.0.0.1, and only to the basic-auth user admin:s3cret."""
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    expected = "Basic " + base64.b64encode(b"admin:s3cret").decode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/v2/health/"):  # a Triton node's health, for https nodes
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            allowed = self.headers.get("Authorization") == expected
            body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
            self.send_response(200 if allowed else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if allowed else b"{}")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://admin:s3cret@127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()


def test_prometheus_certificates_are_checked(
    tls_prometheus: tuple[str, Path], settings: Any
) -> None:
    """The client was built with disable_ssl=True: any certificate was accepted."""
    settings.PROMETHEUS_URL, cert = tls_prometheus
    with pytest.raises(PrometheusUnavailable, match="its TLS certificate is not trusted"):
        instant_query("up")
    settings.PROMETHEUS_CA_BUNDLE = str(cert)
    assert instant_query("up") == []  # trusted, and the URL's credentials were sent


def test_a_node_metrics_redirect_is_not_followed() -> None:
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            self.send_response(302)
            self.send_header("Location", "/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with pytest.raises(TritonUnreachable, match="HTTP Error 302"):
            read_metrics(url, node="n1")
    finally:
        server.shutdown()
    assert hits == ["/metrics"]


def test_an_https_node_is_spoken_to_over_tls(
    tls_prometheus: tuple[str, Path], settings: Any
) -> None:
    """Only host:port of the URL was kept: an https:// node was sent plain HTTP."""
    url, cert = tls_prometheus
    node = TritonClient("https://" + url.split("@")[1], node="n1")
    with pytest.raises(TritonUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        node.health()
    settings.TRITON_CA_BUNDLE = str(cert)
    assert node.health() == "ready"


class Node_(BaseHTTPRequestHandler):
    """A node's HTTP API as far as these tests ask: health, and /metrics of any size."""

    hosts: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.hosts.append(self.headers["Host"])
        body = METRICS if self.path == "/metrics" else b""
        if self.path.startswith("/huge"):
            body = b"#" * (METRICS_MAX_BYTES + 1)
        self.send_response(200)
        if self.path != "/huge-unannounced":  # HTTP/1.0: the body ends when the node closes
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with suppress(OSError):  # a reader that stopped early
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


METRICS = b'nv_gpu_memory_used_bytes{gpu_uuid="GPU-a"} 1\n'


@pytest.fixture
def node_at_a_name(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str]]]:
    """A node at http://triton-node.test:<port>, a name only the check resolves (to 127.0.0.1):
    a second lookup, by the HTTP client, would find nothing. Yields its URL and the lookups."""
    lookups: list[str] = []

    def lookup(host: str) -> list[str]:
        lookups.append(host)
        assert host == "triton-node.test"
        return ["127.0.0.1"]

    monkeypatch.setattr(addresses, "_lookup", lookup)
    Node_.hosts = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Node_)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://triton-node.test:{server.server_address[1]}", lookups
    finally:
        server.shutdown()
        server.server_close()


def test_a_node_is_contacted_at_the_address_that_was_checked(
    node_at_a_name: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, lookups = node_at_a_name

    def resolve_again(*args: object) -> None:  # gevent's resolver: a thread hand-off a call
        raise AssertionError(f"resolved again: {args}")

    monkeypatch.setattr(gevent.socket, "getaddrinfo", resolve_again)
    assert TritonClient(url, node="n1").health() == "ready"  # two requests, one lookup
    assert read_metrics(f"{url}/metrics", node="n1") == METRICS.decode()
    assert lookups == ["triton-node.test"] * 2
    host = url.removeprefix("http://")
    assert Node_.hosts == [host] * 3  # the node still hears its own name


@pytest.mark.parametrize("path", ["/huge", "/huge-unannounced"])
def test_a_nodes_metrics_past_the_cap_are_refused_naming_the_node(
    node_at_a_name: tuple[str, list[str]], path: str
) -> None:
    url, _ = node_at_a_name
    with pytest.raises(TritonRejected, match=rf"^n1: metrics at {url}{path}: larger than 8 MiB"):
        read_metrics(f"{url}{path}", node="n1")


@pytest.fixture
def runtime_api(tmp_path: Path) -> Iterator[tuple[str, list[bytes]]]:
    """HAProxy's runtime API on a unix socket, answering nothing (as `set weight` does when it
    works). Yields the socket's path and what each connection sent."""
    heard: list[bytes] = []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            heard.append(self.rfile.readline())

    path = str(tmp_path / "admin.sock")
    server = socketserver.ThreadingUnixStreamServer(path, Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield path, heard
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "server", ["n1; set server triton_http/n2 state maint", "n1\nshutdown sessions", "n 1", ""]
)
def test_a_name_that_would_be_a_second_command_never_reaches_haproxy(
    runtime_api: tuple[str, list[bytes]], server: str
) -> None:
    path, heard = runtime_api
    with pytest.raises(HAProxyError, match="only letters, digits"):
        Runtime(path).set_weights("triton_http", {"ok-1": 100, server: 0})
    with pytest.raises(HAProxyError, match="only letters, digits"):
        Runtime(path).weights(f"triton_http;{server}")
    Runtime(f"unix:{path}").set_weights("triton_http", {"gpu-a.1": 10})
    assert heard == [b"set weight triton_http/gpu-a.1 10\n"]  # the last call alone

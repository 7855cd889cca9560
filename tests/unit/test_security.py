"""Findings of the security review that are not about one app: sessions, secrets in errors."""

import base64
import ssl
import subprocess
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.test import Client
from django.utils import timezone

from apps.observability.prometheus import PrometheusUnavailable, instant_query

pytestmark = pytest.mark.django_db


def test_a_session_ends_after_an_hour_without_a_request(client: Client, viewer: User) -> None:
    client.force_login(viewer)
    session = Session.objects.get()
    Session.objects.filter(pk=session.pk).update(expire_date=timezone.now() + timedelta(seconds=5))
    assert client.get("/").status_code == 200
    left = Session.objects.get(pk=session.pk).expire_date - timezone.now()
    assert timedelta(minutes=59) < left <= timedelta(hours=1)  # the request started the count again
    Session.objects.filter(pk=session.pk).update(expire_date=timezone.now())
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


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


def test_credentials_in_the_prometheus_url_never_reach_a_page(
    client: Client, viewer: User, settings: Any
) -> None:
    settings.PROMETHEUS_URL = "http://admin:s3cret@127.0.0.1:1/prom"
    with pytest.raises(PrometheusUnavailable) as caught:
        instant_query("up")
    assert str(caught.value) == (
        "Prometheus at http://127.0.0.1:1/prom did not answer: connection failed."
    )
    client.force_login(viewer)
    chart = client.get("/metrics/?metric=p99", headers={"HX-Request": "true"}).content.decode()
    tiles = client.get("/metrics/tiles/").content.decode()
    for page in chart, tiles:
        assert "http://127.0.0.1:1/prom did not answer" in page
        assert "s3cret" not in page

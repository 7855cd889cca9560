"""Findings of the security review that are not about one app: sessions, secrets in errors."""

import io
import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from apps.audit.models import AuditEvent
from apps.fleet.models import Node, NodePool
from apps.fleet.polling import node_poll
from apps.prometheus.client import PrometheusUnavailable, instant_query
from apps.web.guard import client_ip
from tests.support.users import PASSWORD

pytestmark = pytest.mark.django_db


def test_a_session_ends_after_an_hour_without_a_request(
    client: Client, viewer: User, settings: object
) -> None:
    settings.SESSION_TOUCH_S = 60  # type: ignore[attr-defined]
    client.force_login(viewer)
    session = Session.objects.get()
    Session.objects.filter(pk=session.pk).update(expire_date=timezone.now() + timedelta(seconds=5))
    assert client.get("/").status_code == 200
    left = Session.objects.get(pk=session.pk).expire_date - timezone.now()
    assert timedelta(minutes=59) < left <= timedelta(hours=1)  # the request started the count again
    # Written once a minute at most, not on every poll of a live page.
    soon = timezone.now() + timedelta(seconds=5)
    Session.objects.filter(pk=session.pk).update(expire_date=soon)
    assert client.get("/").status_code == 200
    assert Session.objects.get(pk=session.pk).expire_date == soon
    data = client.session
    data["_touched"] -= 60
    data.save()
    Session.objects.filter(pk=session.pk).update(expire_date=soon)
    assert client.get("/").status_code == 200
    assert Session.objects.get(pk=session.pk).expire_date - timezone.now() > timedelta(minutes=59)
    Session.objects.filter(pk=session.pk).update(expire_date=timezone.now())
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")


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


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://169.254.169.254/latest", "169.254.169.254: link-local, multicast and metadata"),
        ("http://[fe80::1]:8000", "fe80::1: link-local, multicast and metadata"),
        ("http://[::ffff:169.254.169.254]:80", "169.254.169.254: link-local"),
        ("http://8.8.8.8:8000", "8.8.8.8, outside NODE_ALLOWED_NETWORKS (127.0.0.0/8, 10.0.0.0/8"),
        ("http://no-such-node.invalid:8000", "no-such-node.invalid does not resolve"),
    ],
)
def test_nodes_are_registered_only_at_allowed_addresses(url: str, reason: str) -> None:
    with pytest.raises(CommandError, match=re.escape(reason)):
        call_command("register_node", "n1", "gpu", url)
    assert not Node.objects.exists()


def test_an_allowed_network_is_a_setting(settings: Any) -> None:
    call_command("register_node", "n1", "gpu", "http://10.1.2.3:8000", stdout=io.StringIO())
    settings.NODE_ALLOWED_NETWORKS = ["8.8.8.0/24"]
    call_command("register_node", "n2", "gpu", "http://8.8.8.8:8000", stdout=io.StringIO())
    assert set(Node.objects.values_list("name", flat=True)) == {"n1", "n2"}


def test_a_node_moved_to_a_refused_address_is_not_contacted() -> None:
    """A row written before the check, or a name whose DNS changed: refused at each call."""
    pool = NodePool.objects.create(name="gpu")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://169.254.169.254:80")
    node_poll(node_id=node.pk)
    node.refresh_from_db()
    assert node.last_error == (
        "n1: 169.254.169.254 is 169.254.169.254: link-local, multicast and metadata addresses"
        " are refused"
    )


def test_sign_ins_are_throttled_per_user_and_address(client: Client, viewer: User) -> None:
    def sign_in(password: str, address: str = "10.0.0.1") -> Any:
        form = {"username": viewer.username, "password": password}
        return client.post("/accounts/login/", form, REMOTE_ADDR=address)

    for _ in range(4):
        assert sign_in("wrong").status_code == 200  # the form again, with its error
    assert sign_in("wrong").status_code == 429  # the fifth failure locks
    locked = sign_in(PASSWORD)  # even the right password, now
    assert locked.status_code == 429 and "Signing in is locked" in locked.content.decode()
    events = AuditEvent.objects.filter(action="login.locked_out")  # each refused try
    assert {(e.target, e.actor, e.result) for e in events} == {
        ("user:viewer-user", "anonymous@10.0.0.1", "denied")
    } and len(events) == 2
    assert sign_in(PASSWORD, address="10.0.0.2").status_code == 302  # not a lock on the user alone


def test_the_client_address_is_what_the_trusted_proxy_saw(rf: Any, settings: Any) -> None:
    request = rf.get("/", REMOTE_ADDR="10.9.9.9", HTTP_X_FORWARDED_FOR="1.2.3.4, 5.6.7.8")
    assert client_ip(request) == "10.9.9.9"  # no proxy trusted: the header is anyone's to write
    settings.TRUSTED_PROXIES = 1
    assert client_ip(request) == "5.6.7.8"
    settings.TRUSTED_PROXIES = 2
    assert client_ip(request) == "1.2.3.4"

"""A refused action says why where it was clicked: htmx swaps nothing on an error by itself, so
every action page answers an htmx refusal with its message and an error status, which
static/app.js shows beside the form; a plain form goes back to its page, which shows it."""

import pytest
from django.contrib.auth.models import User
from django.contrib.messages import get_messages
from django.test import Client

from apps.fleet.models import Node, NodePool

pytestmark = pytest.mark.django_db

REFUSED = [
    ("/nodes/p-1/operate/", {"kind": "drain-all"}, 409, "unknown action 'drain-all'"),
    ("/rollouts/99/skip/", {}, 409, "unknown action 'skip'"),
    ("/rollouts/release/p/rag/sideways/", {}, 409, "unknown target 'sideways'"),
    ("/rollouts/approvals/99/approve/", {}, 409, "there is no approval #99"),
    ("/rollouts/approvals/99/reject/", {"reason": "no"}, 409, "there is no approval #99"),
    ("/pools/p/tiers/rag/pin/", {"tier": "top", "hours": "1"}, 422, "tier and hours: numbers"),
    ("/pools/p/tiers/rag/unpin/", {}, 409, "no model rag"),
    ("/pools/p/tiers/rag/confirm/", {}, 409, "no model rag"),
    ("/pools/p/tiers/set/", {"model": "rag", "versions": "one"}, 409, "versions: numbers"),
    ("/incidents/open/", {"title": "slow"}, 422, "start: expected a date and time"),
    ("/incidents/99/update/", {"status": "resolved"}, 409, "no incident #99"),
    ("/incidents/99/rollback/", {"model": "rag", "pool": "p"}, 409, "no incident #99"),
]


@pytest.mark.parametrize(("url", "form", "status", "why"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_refused_action_answers_htmx_with_why_and_a_plain_form_on_its_page(
    client: Client, admin_user: User, url: str, form: dict[str, str], status: int, why: str
) -> None:
    Node.objects.create(name="p-1", pool=NodePool.objects.create(name="p"), http_url="http://x")
    client.force_login(admin_user)
    htmx = client.post(url, form, headers={"HX-Request": "true"})
    assert htmx.status_code == status
    assert htmx.content.decode().startswith('<p class="flash error">')
    assert why in htmx.content.decode().replace("&#x27;", "'")
    plain = client.post(url, form)
    assert plain.status_code == 302  # back to its page, which shows the message
    assert [why in str(message) for message in get_messages(plain.wsgi_request)] == [True]

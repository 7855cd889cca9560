"""The smaller findings of the security review (issue 26): text from people escaped where it is
exported (Markdown reports, webhook messages, CSV), passwords, the Content Security Policy,
session lifetimes, and sign-in throttling by address."""

import csv
import io
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.contrib.auth.password_validation import validate_password
from django.contrib.sessions.models import Session
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from apps.accounts.management.commands.setup_roles import DEMO_PASSWORD
from apps.audit.services import audit_record
from apps.fleet.models import Node, NodePool
from apps.incidents.models import Incident
from apps.incidents.templatetags.mdtext import md, md_block, md_code
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.rollouts.transitions import notify
from apps.web.sessions import POLL_HEADER, STARTED, TOUCHED
from tests.support.users import PASSWORD

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parents[2]

# Markdown (links, images, headings, emphasis, raw HTML) and a line break to start a block.
HOSTILE = "ok\n# Owned [click](http://evil.example) ![x](http://evil.example/x.png) <img src=x onerror=alert(1)> *loud* &lt; |"
UNESCAPED = re.compile(r"(?<!\\)[<>\[\]&*]")


def outside_code(line: str) -> str:
    return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", line)


def test_markdown_text_filters_leave_nothing_a_renderer_would_read_as_markup() -> None:
    assert md("rag_pipeline v2: 14:05") == "rag_pipeline v2: 14:05"  # plain text stays readable
    one_line = md(HOSTILE)
    assert "\n" not in one_line and UNESCAPED.search(one_line) is None
    assert "\\[click\\](http://evil.example)" in one_line and "\\<img" in one_line
    assert md("_x_ ~~y~~") == "\\_x\\_ \\~\\~y\\~\\~"
    block = md_block("fine\n# heading\n---\n===\n1. item\n2) item\n - item\n+ item\n> quote")
    assert block.splitlines() == [
        "fine",
        "\\# heading",
        "\\---",
        "\\===",
        "1\\. item",
        "2\\) item",
        " \\- item",
        "\\+ item",
        "\\> quote",
    ]
    assert md_code("a``b") == "```a``b```"
    assert md_code("`x") == "`` `x ``"
    assert md_code("a|b") == "`a|b`" and md_code("a|b", "table") == "`a\\|b`"


def test_the_incident_report_shows_what_people_typed_as_text_not_markdown(
    client: Client, operator: User, settings: Any
) -> None:
    settings.PROMETHEUS_URL = "http://127.0.0.1:1"
    client.force_login(operator)
    pool = NodePool.objects.create(name="demo")
    node = Node.objects.create(name="n1", pool=pool, http_url="http://127.0.0.1:1")
    # Names come from Triton's repositories and from registration: they may hold anything.
    model = Model.objects.create(name="m`<b>x</b>`")
    audit_record(
        actor="ops", action="deployment.set", target=f"pool:demo:{HOSTILE}", after={"version": 2}
    )
    incident = Incident.objects.create(
        title=HOSTILE,
        notes=f"{HOSTILE}\n<script>alert(1)</script>\n---",
        started_at=timezone.now() + timedelta(seconds=30),
        opened_by="<b>eve</b>",
        pool=pool,
        model=model,
        node=node,
    )
    audit_record(
        actor="[boss](http://evil.example)",
        action="incident.update",
        target=f"incident:{incident.pk}",
        after={"notes": HOSTILE, "parts": [{"action": "x|y", "target": "<b>t</b>"}]},
    )
    report = client.get(f"/incidents/{incident.pk}/report.md").content.decode()

    lines = report.splitlines()
    headings = [line for line in lines if line.lstrip().startswith("#")]
    assert headings == [
        f"# Incident #{incident.pk}: ok # Owned \\[click\\](http://evil.example) !\\[x\\]"
        "(http://evil.example/x.png) \\<img src=x onerror=alert(1)\\> \\*loud\\* \\&lt; \\|",
        "## Notes",
        "## Suspect changes, most likely first",
        "## What was done",
    ]
    for line in lines:
        text = outside_code(line).replace("**", "")  # the report's own bold suspect titles
        assert UNESCAPED.search(text) is None, line
    assert "- Scope: pool `demo` model `` m`<b>x</b>` `` node `n1`" in report
    assert "\\<script\\>alert(1)\\</script\\>" in report and "\n\\---\n" in report
    table = lines[lines.index("## What was done") + 4 :]
    [row] = [line for line in table if line.startswith("|")]
    assert len(re.findall(r"(?<!\\)\|", row)) == 5  # four cells, however many "|" were typed


def test_the_timeline_report_shows_events_and_the_model_asked_for_as_text(
    client: Client, operator: User
) -> None:
    client.force_login(operator)
    audit_record(
        actor="<!channel>", action="rollout.aborting", target="rollout:1:[x](y)", message=HOSTILE
    )
    model = "rag`[x](http://evil.example)"
    now = timezone.now()
    window = {"start": f"{now - timedelta(hours=1):%Y-%m-%dT%H:%M:%S}", "model": model}
    window["end"] = f"{now + timedelta(minutes=1):%Y-%m-%dT%H:%M:%S}"
    report = client.get("/audit/timeline/report.md", window)
    text = report.content.decode()
    assert ", model ``rag`[x](http://evil.example)``." in text
    [row] = [line for line in text.splitlines() if "rollout.aborting" in line]
    assert UNESCAPED.search(outside_code(row)) is None, row
    assert len(re.findall(r"(?<!\\)\|", row)) == 7
    assert "\\<!channel\\>" in row and "`rollout:1:[x](y)`" in row


def test_a_webhook_message_cannot_ping_a_channel_or_hide_a_link(settings: Any) -> None:
    settings.ROLLOUT_WEBHOOK_URL = "https://hooks.example/x"
    pool = NodePool.objects.create(name="gpu<!here>")
    rollout = Rollout.objects.create(
        model=Model.objects.create(name="rag&<@U123>"),
        pool=pool,
        baseline_version=1,
        canary_version=2,
        plan=[{"percent": 100}],
        state="paused",
        reason="<!channel> see <http://evil.example|the runbook> & act",
    )
    notification = notify(rollout, "paused")
    assert notification is not None
    payload = notification.payload
    texts = [payload["text"], payload["blocks"][0]["text"]["text"]]
    for text in texts:
        assert "&lt;!channel&gt; see &lt;http://evil.example|the runbook&gt; &amp; act" in text
        assert "rag&amp;&lt;@U123&gt; on gpu&lt;!here&gt;" in text
        # The only control sequence left is the message's own link.
        assert re.findall(r"<[^>]*>", text) in ([], [f"<{payload['rollout']['url']}|details>"])


def test_the_csv_export_keeps_formulas_as_text(client: Client, operator: User) -> None:
    client.force_login(operator)
    typed = ['=HYPERLINK("http://evil.example")', "+1+1", "-2+3", "@SUM(A1)", "\tx", "\rx"]
    for value in typed:
        audit_record(actor="ops", action="incident.update", target="incident:1", message=value)
    audit_record(
        actor="=cmd|' /C calc'!A0", action="incident.update", target="@target", message="fine"
    )
    body = b"".join(client.get("/audit/export.csv?action=incident.").streaming_content).decode()
    rows = list(csv.DictReader(io.StringIO(body)))
    assert [row["message"] for row in rows] == [f"'{value}" for value in typed] + ["fine"]
    assert (rows[-1]["actor"], rows[-1]["target"]) == ("'=cmd|' /C calc'!A0", "'@target")
    assert rows[0]["action"] == "incident.update"  # the rest as it was


def test_a_password_needs_twelve_characters() -> None:
    with pytest.raises(ValidationError, match="at least 12 characters"):
        validate_password("q7#Lw9!zPx2")
    validate_password("q7#Lw9!zPx2m")
    validate_password(PASSWORD)  # the tests' users'


def test_the_demo_users_sign_in_with_the_password_they_are_given(client: Client) -> None:
    """Created by code, not a form: the length rule is for people choosing a password."""
    call_command("setup_roles", "--demo-users", stdout=io.StringIO())
    response = client.post("/accounts/login/", {"username": "viewer", "password": DEMO_PASSWORD})
    assert response.status_code == 302


def test_the_content_security_policy_allows_no_base_and_forms_only_to_this_site(
    client: Client,
) -> None:
    policy = client.get("/accounts/login/")["Content-Security-Policy"]
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";") if d.strip())
    assert directives["base-uri"] == "'none'"
    assert directives["form-action"] == "'self'"


# Sessions


POLL = {"HX-Request": "true", POLL_HEADER: "1"}


def session_of(client: Client, **changes: int) -> Session:
    data = client.session
    for key, value in changes.items():
        data[key] = value
    data.save()
    return Session.objects.get(pk=data.session_key)


def test_a_poll_does_not_keep_a_session_alive(client: Client, viewer: User, settings: Any) -> None:
    settings.SESSION_TOUCH_S = 60
    client.force_login(viewer)
    now = int(time.time())
    session = session_of(client, _touched=now - 120)
    expires = session.expire_date
    assert client.get("/", headers=POLL).status_code == 200
    assert Session.objects.get(pk=session.pk).expire_date == expires
    assert client.session[TOUCHED] == now - 120
    assert client.get("/", headers={"HX-Request": "true"}).status_code == 200  # a person's
    assert client.session[TOUCHED] >= now
    assert Session.objects.get(pk=session.pk).expire_date > expires


def test_a_session_ends_after_an_idle_hour_however_many_polls_came(
    client: Client, viewer: User, settings: Any
) -> None:
    settings.SESSION_TOUCH_S = 60
    client.force_login(viewer)
    session_of(client, _touched=int(time.time()) - 3600 + 30)
    for _ in range(3):
        assert client.get("/", headers=POLL).status_code == 200
    # Something else saving the session during a poll does not move the idle count on.
    session_of(client, _touched=int(time.time()) - 3600)
    response = client.get("/", headers=POLL)
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert client.get("/").status_code == 302


def test_a_session_ends_twelve_hours_after_sign_in_however_active(
    client: Client, viewer: User, settings: Any
) -> None:
    assert settings.SESSION_MAX_AGE_S == 12 * 3600
    before = int(time.time())
    assert (
        client.post(
            "/accounts/login/", {"username": viewer.username, "password": PASSWORD}
        ).status_code
        == 302
    )
    assert before <= client.session[STARTED] <= time.time()
    session_of(client, _started=before - 12 * 3600 + 60)
    assert client.get("/").status_code == 200  # active, and within its twelve hours
    session_of(client, _started=before - 12 * 3600)
    response = client.get("/")
    assert response.status_code == 302 and response["Location"].startswith("/accounts/login/")
    assert client.get("/").status_code == 302


def test_a_session_from_before_its_start_was_recorded_is_counted_from_its_next_request(
    client: Client, viewer: User
) -> None:
    client.force_login(viewer)
    data = client.session
    del data[STARTED]
    data.save()
    assert client.get("/").status_code == 200
    assert client.session[STARTED] >= int(time.time()) - 5


def test_every_live_part_of_a_page_marks_its_polls() -> None:
    """static/app.js marks the requests of elements polling with `every`; each template's
    polling trigger is one its pattern recognises."""
    script = (ROOT / "static" / "app.js").read_text()
    block = script.split('addEventListener("htmx:configRequest"', 1)[1]
    pattern = re.search(r"!/(.+?)/\.test\(", block)
    assert pattern and f'headers["{POLL_HEADER}"]' in block
    triggers = [  # each branch of a trigger a template chooses, its variables filled
        re.sub(r"\{\{.*?\}\}", "5", branch)
        for path in (ROOT / "templates").rglob("*.html")
        for trigger in re.findall(r'hx-trigger="([^"]*)"', path.read_text())
        for branch in re.split(r"\{%.*?%\}", trigger)
        if branch
    ]
    polling = [t for t in triggers if "every" in t]
    assert polling, "no live part found"
    for trigger in triggers:
        assert bool(re.search(pattern[1], trigger)) == (trigger in polling), trigger


# Sign-in throttling


def sign_in(username: str, password: str, address: str, **headers: str) -> int:
    form = {"username": username, "password": password}
    return Client().post("/accounts/login/", form, REMOTE_ADDR=address, headers=headers).status_code


def test_one_address_failing_for_many_users_is_locked_out_for_every_user(
    viewer: User, settings: Any
) -> None:
    settings.AXES_FAILURE_LIMIT, settings.AXES_ADDRESS_FAILURE_LIMIT = 5, 8
    for n in range(7):  # a few guesses at each of many users: no pair reaches its limit
        assert sign_in(f"user{n}", "guess", "10.0.0.7") == 200
    assert sign_in(viewer.username, PASSWORD, "10.0.0.7") == 302  # not yet
    assert sign_in("user7", "guess", "10.0.0.7") == 429  # the address's eighth failure
    assert sign_in(viewer.username, PASSWORD, "10.0.0.7") == 429
    assert sign_in(viewer.username, PASSWORD, "10.0.0.8") == 302


def test_a_named_user_is_not_locked_out_for_a_different_client_address_behind_the_ingress(
    viewer: User, settings: Any
) -> None:
    settings.TRUSTED_PROXIES = 1
    ingress = "10.9.9.9"  # every request comes from the controller; the client is what it saw

    def via(client_address: str, password: str) -> int:
        return sign_in(viewer.username, password, ingress, **{"X-Forwarded-For": client_address})

    for _ in range(4):
        assert via("203.0.113.5", "wrong") == 200
    assert via("203.0.113.5", "wrong") == 429
    assert via("203.0.113.5", PASSWORD) == 429
    assert via("198.51.100.9", PASSWORD) == 302
    # A client cannot pick another address: the proxy appends the one it saw.
    assert via("198.51.100.9, 203.0.113.5", PASSWORD) == 429

from datetime import UTC, datetime, timedelta, timezone

from django.template import Context, Template


def test_a_time_is_shown_in_utc_said_so_whatever_zone_it_was_made_in() -> None:
    tokyo = timezone(timedelta(hours=9))
    at = datetime(2026, 12, 2, 3, 4, 5, tzinfo=tokyo)
    rendered = Template('{% utc at "Y-m-d H:i:s" %}|{% utc at "H:i" %}|{% utc gone %}').render(
        Context({"at": at, "gone": None})
    )
    assert rendered == (
        '<time datetime="2026-12-01T18:04:05+00:00">2026-12-01 18:04:05 UTC</time>|'
        '<time datetime="2026-12-01T18:04:05+00:00">18:04 UTC</time>|'
    )


def test_where_recency_matters_a_time_says_how_long_ago_it_was() -> None:
    at = datetime.now(UTC) - timedelta(minutes=3, seconds=10)
    rendered = Template("{% utc at ago=True %}").render(Context({"at": at}))
    assert rendered.startswith(f'<time datetime="{at.isoformat()}">')
    assert rendered.endswith(' UTC</time> <span class="small muted">3\xa0minutes ago</span>')

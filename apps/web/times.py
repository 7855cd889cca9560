"""Times as people in several time zones read them: in UTC, said so, with the viewer's own time
on hover (static/app.js), and how long ago where recency matters. A builtin of the templates:
`{% utc event.created_at "H:i:s" %}`, `{% utc node.last_seen ago=True %}`."""

from datetime import UTC, datetime

from django import template
from django.utils.dateformat import format as date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

register = template.Library()


@register.simple_tag
def utc(at: datetime | None, shown: str = "Y-m-d H:i:s", ago: bool = False) -> SafeString | str:
    """`at` in UTC as `shown` (Django's date format), in a <time> the browser can localise;
    with `ago`, followed by how long ago that was ("3\xa0minutes ago")."""
    if at is None:
        return ""
    at = at.astimezone(UTC)
    time = format_html('<time datetime="{}">{} UTC</time>', at.isoformat(), date_format(at, shown))
    if not ago:
        return time
    return format_html('{} <span class="small muted">{} ago</span>', time, timesince(at))

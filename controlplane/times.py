"""Times as people in several time zones read them: in UTC, said so, with the viewer's own time
on hover (static/app.js). A builtin of the templates: `{% utc event.created_at "H:i:s" %}`."""

from datetime import UTC, datetime

from django import template
from django.utils.dateformat import format as date_format
from django.utils.html import format_html
from django.utils.safestring import SafeString

register = template.Library()


@register.simple_tag
def utc(at: datetime | None, shown: str = "Y-m-d H:i:s") -> SafeString | str:
    """`at` in UTC as `shown` (Django's date format), in a <time> the browser can localise."""
    if at is None:
        return ""
    at = at.astimezone(UTC)
    return format_html('<time datetime="{}">{} UTC</time>', at.isoformat(), date_format(at, shown))

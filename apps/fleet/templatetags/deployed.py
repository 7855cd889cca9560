"""What a pool is told to run, as the overview shows it: a chip per deployment. Written as one
tag rather than a template loop: the overview shows every pool's, hundreds of chips at fleet
size, and a loop resolving two lookups for each was half the page's time."""

from collections.abc import Iterable

from django import template
from django.utils.html import format_html_join
from django.utils.safestring import SafeString, mark_safe

from apps.fleet.models import Deployment

register = template.Library()


@register.simple_tag
def deployed(deployments: Iterable[Deployment]) -> SafeString:
    chips = format_html_join(
        "",
        '<span class="chip">{} v{}</span>',
        ((deployment.model.name, deployment.version) for deployment in deployments),
    )
    return chips or mark_safe('<span class="muted">nothing</span>')

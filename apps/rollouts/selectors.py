"""Reads of the rollouts app that more than one caller needs."""

from apps.rollouts.models import AnalysisTemplate


def template_names() -> list[str]:
    """Every analysis template's name, once, in order."""
    names = AnalysisTemplate.objects.order_by("name").values_list("name", flat=True)
    return list(names.distinct())

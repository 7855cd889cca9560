from django.db.models import Count, Max
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.registry.models import Model


def model_list(request: HttpRequest) -> HttpResponse:
    models = Model.objects.annotate(
        version_count=Count("versions"), latest=Max("versions__version")
    )
    return render(request, "registry/model_list.html", {"models": models})

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.rollouts.models import Rollout


def rollout_list(request: HttpRequest) -> HttpResponse:
    rollouts = Rollout.objects.select_related("model", "pool", "started_by")[:100]
    return render(request, "rollouts/rollout_list.html", {"rollouts": rollouts})

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from apps.accounts.models import ApiToken
from apps.accounts.permissions import current_user
from apps.accounts.services import TokenError, token_create, token_revoke
from apps.web.guard import takes_post

TOKENS_PER_PAGE = 20
TOKEN_EXPIRY_WARNING_DAYS = 7  # a token expiring within this is marked, to be replaced in time


@takes_post
def tokens(request: HttpRequest) -> HttpResponse:
    """The signed-in user's API tokens; a new one is shown on this response only."""
    user = current_user(request)
    context: dict[str, object] = {}
    if request.method == "POST":
        days = request.POST.get("days", "").strip()
        try:
            record, value = token_create(
                user=user,
                name=request.POST.get("name", ""),
                actor=user,
                days=None if not days else int(days) if days.isascii() and days.isdigit() else 0,
                scope=request.POST.get("scope") or ApiToken.Scope.READ,
            )
            context |= {"created": record, "value": value}
        except TokenError as exc:
            context["error"] = str(exc)
    now = timezone.now()
    page = Paginator(ApiToken.objects.filter(user=user), TOKENS_PER_PAGE)
    context |= {
        "page": page.get_page(request.GET.get("page")),
        "scopes": ApiToken.Scope.choices,
        "max_days": settings.API_TOKEN_MAX_DAYS,
        "now": now,
        "soon": now + timedelta(days=TOKEN_EXPIRY_WARNING_DAYS),
    }
    response = render(request, "accounts/tokens.html", context)
    response["Cache-Control"] = "no-store"  # the new token must not linger in a cache
    return response


@takes_post
@require_POST
def token_revoke_view(request: HttpRequest, token_id: int) -> HttpResponse:
    try:
        token = token_revoke(token_id=token_id, actor=current_user(request))
        messages.success(request, f"Revoked {token}: calls with it are refused from now on.")
    except TokenError as exc:
        messages.error(request, str(exc))
    return redirect("accounts:tokens")

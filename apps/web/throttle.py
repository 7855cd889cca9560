"""Sign-in throttling (django-axes) by address as well as by user. A lock on a user alone would
let anyone lock the admins out from everywhere; a lock on a user at an address alone lets one
client try a few passwords of every user. So: AXES_FAILURE_LIMIT failures of one user from one
address lock that pair, and AXES_ADDRESS_FAILURE_LIMIT failures from one address, whoever they
named, lock the address. The address is the client's behind TRUSTED_PROXIES proxies
(apps.web.guard.client_ip): without them, everyone behind the ingress is one address."""

from typing import Any

from axes.attempts import get_cool_off_threshold
from axes.handlers.database import AxesDatabaseHandler
from axes.models import AccessAttempt
from django.conf import settings
from django.db.models import Sum
from django.http import HttpRequest


class AddressThrottleHandler(AxesDatabaseHandler):
    def get_failures(self, request: HttpRequest, credentials: dict[str, Any] | None = None) -> int:
        """The failures counted against AXES_FAILURE_LIMIT: the user's from this address, or the
        address's beyond what its own, higher limit leaves (django-axes compares one count with
        one limit, both where it locks and where it refuses)."""
        pair = super().get_failures(request, credentials)
        attempts = AccessAttempt.objects.filter(ip_address=request.axes_ip_address)  # type: ignore[attr-defined]
        if settings.AXES_COOLOFF_TIME is not None:
            attempts = attempts.filter(attempt_time__gte=get_cool_off_threshold(request))
        address = attempts.aggregate(n=Sum("failures_since_start"))["n"] or 0
        allowance = settings.AXES_ADDRESS_FAILURE_LIMIT - settings.AXES_FAILURE_LIMIT
        return max(pair, address - allowance)

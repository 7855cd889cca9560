"""The audit trail's rule, enforced by tables: every mutating service records exactly one event,
refused or done."""

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from apps.audit.models import AuditEvent
from apps.degradation.services import tier_confirm, tier_pin, tier_unpin, tiers_set
from apps.rollouts.proposals import rollout_start
from apps.rollouts.services import (
    release_fallback,
    release_rollback,
    rollout_abort,
    rollout_pause,
    rollout_promote,
    rollout_resume,
    rollout_retry,
    rollout_roll_back,
    template_save,
)

ROLLOUT_SERVICES = {
    rollout_start,
    rollout_pause,
    rollout_resume,
    rollout_promote,
    rollout_abort,
    rollout_retry,
    rollout_roll_back,
    release_rollback,
    release_fallback,
    template_save,
}

# Their table is in tests/unit/test_degradation.py.
DEGRADATION_SERVICES = {tiers_set, tier_pin, tier_unpin, tier_confirm}


@dataclass(frozen=True)
class Case:
    """A mutating service, a call it refuses and a call it accepts, and the event each records."""

    service: Callable[..., object]
    action: str  # the refusal's event; the accepted call's too unless `done` says otherwise
    refused: Callable[[], object] | None  # None: nothing makes it refuse
    accepted: Callable[[], object]
    done: str = ""  # the accepted call's event when it is named after the state reached


def assert_one_event_each(cases: list[Case]) -> None:
    for case in cases:
        calls = [
            (case.refused, case.action, "failed"),
            (case.accepted, case.done or case.action, "ok"),
        ]
        for call, action, result in calls:
            if call is None:
                continue
            before = AuditEvent.objects.count()
            if result == "ok":
                call()
            else:
                with pytest.raises(Exception):  # noqa: B017 - each service has its own refusal
                    call()
            new = list(AuditEvent.objects.all()[: AuditEvent.objects.count() - before])
            assert [(e.action, e.result) for e in new] == [(action, result)], case.service
            if result == "failed":
                assert new[0].message, f"{action}: a refusal says why"

from django.apps import AppConfig


class ApprovalsConfig(AppConfig):
    """Two people for a protected pool: changes held for a second person, above the rollouts
    and the fleet whose services they carry out."""

    name = "apps.approvals"
    label = "approvals"

from django.apps import AppConfig


class StatefilesConfig(AppConfig):
    """Each pool's desired state as a file for the team's Git repository: written out, compared
    with the database, and applied through the services a person uses."""

    name = "apps.statefiles"
    label = "statefiles"

"""The four roles are Django groups; each role holds the permissions of the ones below it."""

from enum import StrEnum


class Role(StrEnum):
    VIEWER = "viewer"
    OPERATOR = "operator"
    RELEASE_MANAGER = "release_manager"
    ADMIN = "admin"


ROLE_ORDER = [Role.VIEWER, Role.OPERATOR, Role.RELEASE_MANAGER, Role.ADMIN]

# Permission codenames (app_label.codename) granted by each role on top of the previous role's.
ROLE_GRANTS: dict[Role, list[str]] = {
    Role.VIEWER: [
        "fleet.view_node",
        "fleet.view_nodepool",
        "registry.view_model",
        "registry.view_modelversion",
        "rollouts.view_rollout",
        "audit.view_auditevent",
        "incidents.view_incident",
    ],
    Role.OPERATOR: [
        "fleet.operate_node",
        "fleet.add_node",
        "fleet.change_node",
        "rollouts.rollback_release",  # on-call rolls back without waiting for a release manager
        "incidents.manage_incident",
    ],
    Role.RELEASE_MANAGER: [
        "registry.add_model",
        "registry.add_modelversion",
        "registry.change_modelversion",
        "quality.add_evaluationset",  # import a set
        "quality.add_evaluationrun",  # send a set's cases to a node
        "performance.add_perfrun",  # measure a version on a node with perf_analyzer
        "rollouts.add_rollout",
        "rollouts.change_rollout",
    ],
    Role.ADMIN: ["fleet.delete_node", "fleet.add_nodepool", "fleet.change_nodepool"],
}


def role_permissions(role: Role) -> list[str]:
    granted: list[str] = []
    for each in ROLE_ORDER[: ROLE_ORDER.index(role) + 1]:
        granted += ROLE_GRANTS[each]
    return granted


def roles_granting(permission: str) -> list[Role]:
    """The roles whose permissions include `permission`."""
    return [role for role in ROLE_ORDER if permission in role_permissions(role)]

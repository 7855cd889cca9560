"""`{% may "fleet.operate_node" pool as allowed %}`: whether to show an action's button, by the
same rule its service enforces (a global role, or one held on that pool; no pool: any pool)."""

from typing import Any

from django import template

from apps.accounts.permissions import may, may_somewhere

register = template.Library()


@register.simple_tag(takes_context=True)
def may_act(context: dict[str, Any], permission: str, pool: Any = None) -> bool:
    user = context["request"].user
    return may_somewhere(user, permission) if pool is None else may(user, permission, pool.pk)

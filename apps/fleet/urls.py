from django.urls import path

from apps.fleet import views

app_name = "fleet"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("nodes/", views.nodes, name="nodes"),
    path("nodes/serving/", views.serving, name="serving"),
    path("footprints/", views.footprints, name="footprints"),
    path("nodes/<slug:name>/", views.node_detail, name="node_detail"),
    path("nodes/<slug:name>/load/", views.node_load, name="node_load"),
    path("nodes/<slug:name>/operate/", views.node_operate, name="node_operate"),
    path("deployments/", views.deployments, name="deployments"),
    path("pools/roles/", views.pool_roles, name="pool_roles"),
    path("pools/<slug:pool>/capacity/", views.pool_capacity, name="pool_capacity"),
    path("pools/<slug:pool>/fit/", views.pool_fit, name="pool_fit"),
    path("deployments/<slug:pool>/", views.deployment_create, name="deployment_create"),
    path(
        "deployments/<int:deployment_id>/remove/", views.deployment_delete, name="deployment_delete"
    ),
]

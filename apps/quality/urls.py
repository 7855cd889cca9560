from django.urls import path

from apps.quality import views

app_name = "quality"
urlpatterns = [
    path("models/<str:name>/evaluations/", views.set_list, name="set_list"),
    path("models/<str:name>/evaluations/import/", views.set_import, name="set_import"),
    path(
        "models/<str:name>/evaluations/<str:set_name>/v<int:version>/",
        views.set_detail,
        name="set_detail",
    ),
    path(
        "models/<str:name>/evaluations/<str:set_name>/v<int:version>/run/",
        views.run_start,
        name="run_start",
    ),
    path(
        "models/<str:name>/v<int:version>/quality/", views.version_quality, name="version_quality"
    ),
    path("evaluations/runs/<int:pk>/", views.run_detail, name="run_detail"),
]

from django.urls import path

from apps.registry import views

app_name = "registry"
urlpatterns = [
    path("", views.model_list, name="model_list"),
    path("import/", views.repository_upload, name="import"),
    path("<str:name>/", views.model_detail, name="model_detail"),
    path("<str:name>/new/", views.version_new, name="version_new"),
    path("<str:name>/validate/", views.version_validate, name="version_validate"),
    path("<str:name>/diff/", views.version_diff, name="version_diff"),
    path("<str:name>/v<int:version>/", views.version_detail, name="version_detail"),
    path("<str:name>/v<int:version>/config.pbtxt", views.version_config, name="version_config"),
    path("<str:name>/v<int:version>/repository.zip", views.version_archive, name="version_archive"),
    path("<str:name>/v<int:version>/status/", views.version_status, name="version_status"),
]

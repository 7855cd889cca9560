from django.urls import path

from apps.audit import views

app_name = "audit"
urlpatterns = [
    path("", views.audit_list, name="audit_list"),
    path("export.csv", views.audit_export, {"fmt": "csv"}, name="audit_export_csv"),
    path("export.json", views.audit_export, {"fmt": "json"}, name="audit_export_json"),
]

from django.urls import path

from apps.incidents import views

app_name = "incidents"
urlpatterns = [
    # The timeline keeps the address it had under the audit trail: permalinks in postmortems.
    path("audit/timeline/", views.timeline, name="timeline"),
    path("audit/timeline/report.md", views.timeline_report, name="timeline_report"),
    path("audit/timeline/chart/", views.timeline_chart, name="timeline_chart"),
    path("incidents/", views.incident_list, name="incident_list"),
    path("incidents/open/", views.incident_open_view, name="incident_open"),
    path("incidents/<int:pk>/", views.incident_detail, name="incident_detail"),
    path("incidents/<int:pk>/update/", views.incident_update_view, name="incident_update"),
    path("incidents/<int:pk>/rollback/", views.incident_rollback_view, name="incident_rollback"),
    path("incidents/<int:pk>/report.md", views.incident_report, name="incident_report"),
]

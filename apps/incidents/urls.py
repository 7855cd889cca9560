from django.urls import path

from apps.incidents import views

app_name = "incidents"
urlpatterns = [
    path("", views.timeline, name="timeline"),
    path("report.md", views.timeline_report, name="timeline_report"),
    path("chart/", views.timeline_chart, name="timeline_chart"),
]

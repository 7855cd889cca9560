from django.urls import path

from apps.audit import views

app_name = "audit"
urlpatterns = [
    path("", views.audit_list, name="audit_list"),
    path("timeline/", views.timeline, name="timeline"),
]

from django.urls import path

from apps.fleet import views

app_name = "fleet"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("nodes/", views.nodes, name="nodes"),
    path("nodes/serving/", views.serving, name="serving"),
]

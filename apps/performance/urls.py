from django.urls import path

from apps.performance import views

app_name = "performance"
urlpatterns = [
    path("pools/<slug:pool>/throughput/", views.pool_throughput, name="pool_throughput"),
    path("pipelines/<str:name>/searches/", views.search_list, name="search_list"),
    path("pipelines/<str:name>/searches/start/", views.search_new, name="search_start"),
    path("searches/<int:pk>/", views.search_detail, name="search_detail"),
]

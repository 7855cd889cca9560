from django.urls import path

from apps.performance import views

app_name = "performance"
urlpatterns = [
    path("pools/<slug:pool>/throughput/", views.pool_throughput, name="pool_throughput"),
]

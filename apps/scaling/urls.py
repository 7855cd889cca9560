from django.urls import path

from apps.scaling import views

app_name = "scaling"
urlpatterns = [
    path("pools/<slug:pool>/scaling/", views.pool_scaling, name="pool"),
    path("pools/<slug:pool>/scaling/pin/", views.pin, name="pin"),
    path("pools/<slug:pool>/scaling/bounds/", views.bounds, name="bounds"),
]

from django.urls import path

from apps.degradation import views

app_name = "degradation"
urlpatterns = [
    path("pools/<slug:pool>/tiers/", views.pool_tiers, name="tiers"),
    path("pools/<slug:pool>/tiers/set/", views.set_tiers, name="set"),
    path("pools/<slug:pool>/tiers/<str:model>/pin/", views.pin, name="pin"),
    path("pools/<slug:pool>/tiers/<str:model>/unpin/", views.unpin, name="unpin"),
    path("pools/<slug:pool>/tiers/<str:model>/confirm/", views.confirm, name="confirm"),
]

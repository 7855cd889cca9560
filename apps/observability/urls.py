from django.urls import path

from apps.observability import views

app_name = "observability"
urlpatterns = [
    path("", views.metrics, name="metrics"),
    path("breakdown/<str:name>/", views.breakdown, name="breakdown"),
    path("tiles/", views.tiles, name="tiles"),
    path("bottleneck/<str:name>/", views.bottleneck, name="bottleneck"),
]

from django.urls import path

from apps.rollouts import views

app_name = "rollouts"
urlpatterns = [
    path("", views.rollout_list, name="rollout_list"),
    path("new/", views.rollout_new, name="rollout_new"),
    path("tune/<str:name>/", views.tune, name="tune"),
    path("tune/searches/<int:pk>/", views.search_release, name="search_release"),
    path("<int:pk>/", views.rollout_detail, name="rollout_detail"),
    path("<int:pk>/<slug:action>/", views.rollout_act, name="rollout_act"),
    path(
        "release/<slug:pool>/<str:model>/<slug:to>/",
        views.release_roll_back,
        name="release_roll_back",
    ),
]

from django.urls import path

from apps.rollouts import views

app_name = "rollouts"
urlpatterns = [path("", views.rollout_list, name="rollout_list")]

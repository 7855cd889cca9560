from django.urls import path

from apps.registry import views

app_name = "registry"
urlpatterns = [path("", views.model_list, name="model_list")]

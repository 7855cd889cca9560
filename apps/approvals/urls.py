from django.urls import path

from apps.approvals import views

app_name = "approvals"
urlpatterns = [
    path("", views.approval_list, name="list"),
    path("<int:pk>/approve/", views.approval_approve_view, name="approve"),
]

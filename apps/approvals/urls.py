from django.urls import path

from apps.approvals import views

app_name = "approvals"
urlpatterns = [
    path("", views.approval_list, name="list"),
    path("<int:pk>/approve/", views.approval_approve_view, name="approve"),
    path("<int:pk>/reject/", views.approval_reject_view, name="reject"),
    path("<int:pk>/withdraw/", views.approval_withdraw_view, name="withdraw"),
]

from django.contrib.auth import views as auth_views
from django.urls import path

from apps.accounts import views
from apps.web.guard import takes_post

app_name = "accounts"
urlpatterns = [
    path("login/", takes_post(auth_views.LoginView.as_view()), name="login"),
    path("logout/", takes_post(auth_views.LogoutView.as_view()), name="logout"),
    path("tokens/", views.tokens, name="tokens"),
    path("tokens/<int:token_id>/revoke/", views.token_revoke_view, name="token_revoke"),
]

"""What a request may carry, refused before anything reads or stores its body."""

import io
import json
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.core.files.uploadhandler import TemporaryFileUploadHandler
from django.test import Client

from apps.accounts.roles import Role
from apps.web.guard import MAX_JSON_DEPTH
from tests.support.users import bearer, make_user

pytestmark = pytest.mark.django_db


def nested(depth: int, leaf: str = '"\\u0000"') -> str:
    return "[" * depth + leaf + "]" * depth


@pytest.mark.parametrize("path", ["/", "/accounts/login/", "/api/models/ocr/validate"])
def test_deeply_nested_json_is_a_clear_400_not_a_recursion_error(
    client: Client, admin_user: User, path: str
) -> None:
    """It was a 500 (RecursionError) on every page, even before login."""
    body = nested(100_000)
    anonymous = client.post(path, body, content_type="application/json")
    assert anonymous.status_code == 400
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in anonymous.content.decode()
    signed = client.post(path, nested(100_000, "1"), "application/json", headers=bearer(admin_user))
    assert signed.status_code == 400


def test_json_as_deep_as_the_limit_still_reaches_the_view(client: Client, admin_user: User) -> None:
    body = {"pbtxt": 'name: "ocr"', "extra": json.loads(nested(MAX_JSON_DEPTH - 2, "1"))}
    response = client.post(
        "/api/models/ocr/validate", json.dumps(body), "application/json", headers=bearer(admin_user)
    )
    assert response.status_code == 200, response.content


def test_a_body_over_the_cap_is_refused_unread(client: Client, settings: Any) -> None:
    settings.REQUEST_BODY_MAX_BYTES = 1000
    response = client.post("/accounts/login/", {"username": "x" * 2000, "password": "y"})
    assert response.status_code == 413
    assert response.content == b"the request body is larger than 0 MiB"
    api = client.post("/api/import", "x" * 2000, content_type="application/octet-stream")
    assert api.status_code == 413 and api.json()["error"]["code"] == "too_large"


class Recorder(TemporaryFileUploadHandler):
    """Django's own upload handler, counting the files it is handed."""

    files: list[str] = []

    def new_file(self, field_name: str, file_name: str, *args: Any, **kwargs: Any) -> None:
        Recorder.files.append(file_name)
        super().new_file(field_name, file_name, *args, **kwargs)


@pytest.fixture
def recorder(settings: Any) -> type[Recorder]:
    settings.FILE_UPLOAD_HANDLERS = [f"{__name__}.Recorder"]
    Recorder.files = []
    return Recorder


def upload() -> io.BytesIO:
    data = io.BytesIO(b"PK\x05\x06" + bytes(18))  # an empty zip
    data.name = "repo.zip"
    return data


def test_an_anonymous_upload_is_never_spooled(recorder: type[Recorder]) -> None:
    """Before, the CSRF check parsed the whole multipart body to disk, then login redirected."""
    client = Client(enforce_csrf_checks=True)
    client.cookies["csrftoken"] = "a" * 32  # with a cookie, CSRF reads the form's token
    page = client.post("/models/import/", {"archive": upload()})
    assert page.status_code == 302 and page["Location"].startswith("/accounts/login/")
    api = client.post("/api/import", {"archive": upload()})
    assert api.status_code == 401 and api.json()["error"]["code"] == "unauthenticated"
    assert recorder.files == []
    client.force_login(make_user(Role.RELEASE_MANAGER))
    client.post("/models/import/", {"archive": upload()})
    assert recorder.files == ["repo.zip"]  # signed in, the same upload is read (CSRF reads it)

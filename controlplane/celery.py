import os

from celery import Celery
from celery.signals import before_task_publish, task_prerun

from apps.audit.context import adopt_request_id, carry_request_id

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("controlplane")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
before_task_publish.connect(carry_request_id)
task_prerun.connect(adopt_request_id)

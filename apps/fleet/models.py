from django.db import models


class NodePool(models.Model):
    name = models.SlugField(max_length=60, unique=True)
    labels = models.JSONField(default=dict, blank=True)
    traffic_strategy = models.CharField(max_length=30, default="nodes")

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    class Health(models.TextChoices):
        UNKNOWN = "unknown"
        READY = "ready"
        LIVE = "live", "live, not ready"
        UNREACHABLE = "unreachable"

    name = models.SlugField(max_length=60, unique=True)
    pool = models.ForeignKey(NodePool, on_delete=models.PROTECT, related_name="nodes")
    http_url = models.URLField()
    grpc_url = models.CharField(max_length=200, blank=True)
    metrics_url = models.URLField(blank=True)
    labels = models.JSONField(default=dict, blank=True)
    triton_version = models.CharField(max_length=30, blank=True)
    extensions = models.JSONField(default=list, blank=True)
    health = models.CharField(max_length=20, choices=Health.choices, default=Health.UNKNOWN)
    failed_polls = models.PositiveIntegerField(default=0)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    index = models.JSONField(default=list, blank=True, help_text="last repository index read")

    class Meta:
        ordering = ["pool__name", "name"]
        permissions = [("operate_node", "Load, unload and reload models on a node")]

    def __str__(self) -> str:
        return self.name

    @property
    def ready_models(self) -> list[dict]:
        return [entry for entry in self.index if entry.get("state") == "READY"]

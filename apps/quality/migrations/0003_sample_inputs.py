"""Each model's sample inputs, from its newest evaluation set, for the warm-ups and probes that
read them from the registry now (a set imported later fills them by itself)."""

from django.db import migrations

SAMPLE_CASES = 20  # as apps.quality.services


def fill(apps: object, schema_editor: object) -> None:
    from apps.fleet.triton import tensors_json
    from apps.quality.cases import Signature
    from apps.quality.runner import request

    evaluation_set = apps.get_model("quality", "EvaluationSet")  # type: ignore[attr-defined]
    seen: set[int] = set()
    for found in evaluation_set.objects.order_by("model_id", "-created_at", "-id"):
        if found.model_id in seen:
            continue  # an older set of a model already done
        seen.add(found.model_id)
        model = found.model
        versions = model.versions.order_by("-version")
        reference = versions.filter(status="published").first() or versions.first()
        if reference is None:
            continue
        signature = Signature.of(reference.config)
        try:
            samples = [
                tensors_json(request(case.inputs, signature))
                for case in found.cases.order_by("line")[:SAMPLE_CASES]
            ]
        except (KeyError, ValueError):  # its cases no longer fit: metadata samples, as before
            continue
        model.sample_inputs = samples
        model.save(update_fields=["sample_inputs"])


class Migration(migrations.Migration):
    dependencies = [
        ("quality", "0002_synthetic_load"),
        ("registry", "0007_sample_inputs"),
    ]

    operations = [migrations.RunPython(fill, migrations.RunPython.noop)]

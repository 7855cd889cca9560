from typing import Any

from django import forms
from django.urls import reverse_lazy

from apps.fleet.models import NodePool
from apps.quality.selectors import published_versions, set_names
from apps.registry.models import Model
from apps.rollouts.models import Rollout
from apps.rollouts.plans import Analysis
from apps.rollouts.selectors import template_names

DEFAULT_PLAN = "1 node, hold 60s\n50%, hold 120s\n100%"
DEFAULTS = Analysis()


class RolloutForm(forms.Form):
    # Choosing a model fetches its published versions and evaluation sets (the page's
    # "model-fields" partial); without JavaScript, a preview does.
    model = forms.ModelChoiceField(
        Model.objects.all(),
        to_field_name="name",
        widget=forms.Select(
            attrs={
                "hx-get": reverse_lazy("rollouts:rollout_new"),
                "hx-target": "#canary-field",
                "hx-swap": "outerHTML",
            }
        ),
    )
    pool = forms.ModelChoiceField(NodePool.objects.all(), to_field_name="name")
    canary_version = forms.TypedChoiceField(
        coerce=int,
        label="Canary version",
        error_messages={
            "invalid_choice": "v%(value)s is not a version of the model with status published."
        },
    )
    strategy = forms.ChoiceField(
        required=False,  # a canary, unless chosen
        choices=Rollout.Strategy.choices,
        initial=Rollout.Strategy.CANARY,
        widget=forms.RadioSelect,
        help_text="Blue-green releases a pipeline whose new step versions (a re-indexed "
        "knowledge base) load beside the old on every node, are evaluated there, then take "
        "every node at once; its plan is that one step.",
    )
    plan = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 4}),
        initial=DEFAULT_PLAN,
        help_text="One step per line: '1 node, hold 60s', '50%, hold 2m', '100%'.",
    )
    lockstep = forms.CharField(
        required=False,
        label="Release with it (lockstep)",
        help_text="Other models the pool runs, released as one: 'embedder:2, generator:2'.",
    )
    accept_shares = forms.BooleanField(
        required=False,
        label="Accept the real shares",
        help_text="A percent step puts the canary on whole nodes: 5% of 3 nodes is 1 node, 33%.",
    )
    interval_s = forms.IntegerField(min_value=1, initial=DEFAULTS.interval_s, label="Every (s)")
    window_s = forms.IntegerField(min_value=5, initial=DEFAULTS.window_s, label="Window (s)")
    p99_tolerance = forms.FloatField(
        min_value=0, initial=DEFAULTS.p99_tolerance, label="P99 tolerance (fraction)"
    )
    p99_margin_ms = forms.IntegerField(
        min_value=0, initial=DEFAULTS.p99_margin_ms, label="P99 margin (ms)"
    )
    warmup_s = forms.IntegerField(min_value=0, initial=DEFAULTS.warmup_s, label="Warm-up (s)")
    error_delta = forms.FloatField(min_value=0, initial=DEFAULTS.error_delta, label="Error delta")
    min_requests = forms.IntegerField(
        min_value=1, initial=DEFAULTS.min_requests, label="Min requests"
    )
    failure_limit = forms.IntegerField(
        min_value=1, initial=DEFAULTS.failure_limit, label="Failure limit"
    )
    template = forms.ChoiceField(
        choices=lambda: (
            [("", "none: the values below")] + [(name, name) for name in template_names()]
        ),
        required=False,
        label="Analysis template",
        help_text="Its latest version; the values you change below override it.",
    )
    judge = forms.ChoiceField(
        choices=[
            ("threshold", "thresholds on the window's values"),
            ("statistical", "statistical, on per-interval samples"),
        ],
        initial=DEFAULTS.judge,
        required=False,
    )
    dry_run = forms.BooleanField(
        required=False,
        label="Dry run",
        help_text="Measure and record every verdict, never act on one.",
    )
    strict_budget = forms.BooleanField(
        required=False,
        label="Strict LLM budget",
        help_text="Refuse a release whose LLM step's first token and longest answer (max_tokens "
        "at the time per token measured on the pool) would not fit its budget; otherwise it is "
        "only warned of.",
    )
    quality_set = forms.ChoiceField(
        required=False,
        label="Evaluation set",
        help_text="Its cases run against canary and baseline once the canary is READY, before "
        "any traffic; none: no gate, unless the analysis template names one.",
    )
    quality_min_score = forms.FloatField(
        required=False,
        initial=DEFAULTS.quality_min_score,
        label="Min score (share of cases)",
    )
    quality_tolerance = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        initial=DEFAULTS.quality_tolerance,
        label="Tolerance below the baseline",
    )

    perf_concurrency = forms.CharField(
        required=False,
        max_length=20,
        label="Concurrency range",
        help_text="perf_analyzer's start:end:step, such as 1:4 or 2:8:2; empty: no gate, unless "
        "the analysis template asks for one.",
    )
    perf_requests = forms.IntegerField(
        required=False,
        min_value=1,
        initial=DEFAULTS.perf_requests,
        label="Requests at each concurrency",
    )
    perf_throughput_tolerance = forms.FloatField(
        required=False,
        min_value=0,
        max_value=1,
        initial=DEFAULTS.perf_throughput_tolerance,
        label="Throughput tolerance below the baseline",
    )
    perf_p99_tolerance = forms.FloatField(
        required=False,
        min_value=0,
        initial=DEFAULTS.perf_p99_tolerance,
        label="P99 tolerance above the baseline",
    )

    TARGET = ["model", "pool", "canary_version", "strategy", "lockstep", "template"]
    QUALITY = ["quality_set", "quality_min_score", "quality_tolerance"]
    PERF = ["perf_concurrency", "perf_requests", "perf_throughput_tolerance", "perf_p99_tolerance"]
    ANALYSIS = [
        "interval_s",
        "window_s",
        "warmup_s",
        "p99_tolerance",
        "p99_margin_ms",
        "error_delta",
        "min_requests",
        "failure_limit",
        "judge",
        "dry_run",
        "strict_budget",
        *QUALITY,
        *PERF,
    ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name = (self.data if self.is_bound else self.initial).get("model") or ""
        model = Model.objects.filter(name=name).first() if name else None
        self.versions = published_versions(model_id=model.pk) if model else []
        # Not "model": a select's label takes its chosen option's text, and "Model" must name
        # the model's select alone.
        if model is None:
            empty = "pick what to release first"
        elif self.versions:
            empty = "choose a published version"
        else:
            empty = "none has status published"
        canary, quality = self.fields["canary_version"], self.fields["quality_set"]
        assert isinstance(canary, forms.ChoiceField) and isinstance(quality, forms.ChoiceField)
        canary.choices = [("", empty), *((v.version, v.label) for v in self.versions)]
        sets = set_names(model_id=model.pk) if model else []
        quality.choices = [("", "none"), *((name, name) for name in sets)]
        self.sets_note = f"{model.name} has no evaluation set yet" if model and not sets else ""

    def clean_quality_min_score(self) -> float | None:
        value: float | None = self.cleaned_data["quality_min_score"]
        if value is not None and not 0 < value <= 1:
            raise forms.ValidationError("a share of the cases: above 0, at most 1")
        return value

    def clean_strategy(self) -> str:
        return self.cleaned_data["strategy"] or Rollout.Strategy.CANARY

    def clean_lockstep(self) -> list[tuple[str, int]]:
        found = []
        for item in filter(None, (i.strip() for i in self.cleaned_data["lockstep"].split(","))):
            name, _, version = item.partition(":")
            if not name.strip() or not version.strip().isdecimal():
                raise forms.ValidationError(f"{item!r} is not MODEL:VERSION, such as embedder:2")
            found.append((name.strip(), int(version)))
        return found

    def target_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.TARGET]

    def analysis_fields(self) -> list[forms.BoundField]:
        grouped = self.QUALITY + self.PERF
        return [self[name] for name in self.ANALYSIS if name not in grouped]

    def quality_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.QUALITY]

    def perf_fields(self) -> list[forms.BoundField]:
        return [self[name] for name in self.PERF]

    def analysis(self) -> dict[str, object]:
        """The values changed from the defaults the form shows: over a template, only those
        override it."""
        given = {name: self.cleaned_data[name] for name in self.ANALYSIS}
        return {
            name: value
            for name, value in given.items()
            if value not in ("", None) and value != getattr(DEFAULTS, name)
        }

"""The one set of verdicts, from the judge and the SLO gate to a measurement, a round and the
controller: what a comparison, a burn rate, an evaluation or a whole step found."""

from django.db import models


class Verdict(models.TextChoices):
    SUCCESS = "success"
    MARGINAL = "marginal"  # worse than the baseline, but within tolerance or unproven
    FAILURE = "failure"
    INCONCLUSIVE = "inconclusive"  # too few samples, or data missing: wait, never guess
    ERROR = "error"  # the measurement itself could not be taken

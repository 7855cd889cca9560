"""Failed loads told apart by Triton's words, and which of them the reconciler tries again. A
permanent failure (files missing, a config Triton rejects, a load refused before it was sent for
want of memory) fails the same way until something changes, so the reconciler leaves it to a
person or a new desired state; a transient one (out of memory, which a later unload may cure; a
backend error; no answer in time) is tried again after 15 s, 30 s and 60 s, then left too. A load
still LOADING when its time is up is stuck: it is never tried again there, and its node is
quarantined (apps/fleet/runner.py)."""

import re
from datetime import datetime, timedelta

MEMORY = "memory"  # refused before it was sent (apps/fleet/memory.py)
OUT_OF_MEMORY = "out_of_memory"
MISSING = "missing"
CONFIG = "config"
BACKEND = "backend"
TIMEOUT = "timeout"
STUCK = "stuck"  # no answer in time, and still LOADING: the node is quarantined
CHOICES = [
    (MEMORY, "would not fit: not sent"),
    (OUT_OF_MEMORY, "out of memory"),
    (MISSING, "files missing"),
    (CONFIG, "config rejected"),
    (BACKEND, "backend error"),
    (TIMEOUT, "no answer in time"),
    (STUCK, "stuck loading"),
]
TRANSIENT = frozenset({OUT_OF_MEMORY, BACKEND, TIMEOUT})
RETRY_BASE_S = 15
TRIES = 4  # the first, and three more

_WORDS = [
    (
        OUT_OF_MEMORY,
        r"out of memory|\bOOM\b|bad_alloc|MemoryError|failed to allocate|cudaErrorMemoryAllocation",
    ),
    (
        MISSING,
        r"did not find v|no such file|not found|unable to find|does not exist|failed to stat|"
        r"no version|cannot open|no module named",
    ),
    (CONFIG, r"invalid argument|invalid|unexpected|unknown (?:field|backend|platform)|parse"),
    (TIMEOUT, r"timed? ?out|timeout|deadline exceeded"),
]
_PATTERNS = [(kind, re.compile(words, re.IGNORECASE)) for kind, words in _WORDS]


def classify(error: str) -> str:
    """The kind of a failed load, from what Triton said (or what reading it back showed)."""
    return next((kind for kind, found in _PATTERNS if found.search(error)), BACKEND)


def retry_at(kind: str, tries: int, finished_at: datetime) -> datetime | None:
    """When a load that failed `tries` times in a row, the last as `kind`, is tried again; None:
    not by the reconciler."""
    if kind not in TRANSIENT or tries >= TRIES:
        return None
    return finished_at + timedelta(seconds=RETRY_BASE_S * 2 ** (tries - 1))

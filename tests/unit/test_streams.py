"""A streamed answer read whole, and a streaming pipeline judged on its LLM step's series."""

import numpy as np
import pytest

from apps.fleet.triton import joined
from apps.registry.models import Model
from apps.rollouts.members import Member, judged_by
from tests.support.registry import import_demo


def text(*pieces: str) -> list[np.ndarray]:
    return [np.array([[p.encode()]], dtype=np.object_) for p in pieces]


def test_a_streamed_text_is_its_pieces_in_order_and_a_repeated_output_is_said_once() -> None:
    assert joined(text("Choose", " Forgot", " password"))[0][0] == b"Choose Forgot password"
    assert joined(text("faq:3", "faq:3", "faq:3"))[0][0] == b"faq:3"
    counts = [np.array([1], dtype=np.int64), np.array([2], dtype=np.int64)]
    assert joined(counts).tolist() == [2]  # a number: its last value


@pytest.mark.django_db
def test_a_pipeline_release_is_judged_on_the_series_of_the_step_that_streams() -> None:
    import_demo()
    pipeline = Model.objects.get(name="rag_pipeline")
    slow_first_token = judged_by(Member(pipeline, baseline=10, canary=12))
    assert slow_first_token.speaker == "llm"
    assert [(s.model, s.canary, s.baseline) for s in slow_first_token.steps] == [("llm", 3, 1)]
    # The move to streaming: the canary's LLM step speaks, with nothing of its own to compare.
    to_streaming = judged_by(Member(pipeline, baseline=2, canary=10))
    assert (to_streaming.speaker, to_streaming.steps) == ("llm", [])
    assert judged_by(Member(pipeline, baseline=1, canary=2)).speaker == "rag_pipeline"
    reranker = Model.objects.get(name="reranker")
    assert judged_by(Member(reranker, baseline=1, canary=2)).speaker == "reranker"

from apps.observability.catalog import METRICS, build_query, step_for
from apps.observability.prometheus import escape_label


def test_label_values_cannot_break_out_of_their_quotes() -> None:
    hostile = 'x"} or vector(1) or {a="'
    query = build_query(METRICS["p99"], model=hostile)
    assert escape_label(hostile) == 'x\\"} or vector(1) or {a=\\"'
    assert f'model="{escape_label(hostile)}"' in query


def test_p99_takes_the_worst_node_never_an_average() -> None:
    query = build_query(METRICS["p99"], model="rag_pipeline", pool="demo")
    assert query.startswith("max by (model, version) (nv_inference_request_summary_us{")
    assert 'quantile="0.99",model="rag_pipeline",pool="demo"' in query
    assert "avg" not in query


def test_batch_size_is_inferences_per_execution() -> None:
    query = build_query(METRICS["batch"], model="embedder", window_s=60)
    assert 'rate(nv_inference_count{model="embedder"}[60s])' in query
    assert 'rate(nv_inference_exec_count{model="embedder"}[60s])' in query


def test_steps_keep_charts_at_a_few_hundred_points() -> None:
    for seconds in [900, 3600, 6 * 3600, 7 * 86400]:
        assert seconds / step_for(seconds) <= 450

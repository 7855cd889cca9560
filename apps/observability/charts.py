"""Plotly figures from Prometheus series, with vertical markers for what changed."""

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from apps.observability.catalog import METRICS, build_query, step_for
from apps.observability.markers import Marker, change_markers
from apps.observability.prometheus import PrometheusUnavailable, Series, range_query


@dataclass(frozen=True)
class Chart:
    title: str
    figure_json: str = ""
    message: str = ""  # shown instead of the figure: no data, Prometheus down...
    note: str = ""  # shown under the figure: how to read it


def series_name(labels: dict[str, str]) -> str:
    if "model" not in labels and "node" in labels:  # per node (and per GPU for memory)
        return " ".join(filter(None, [labels["node"], labels.get("gpu_uuid", "")]))
    parts = [labels.get("model", "all"), f"v{labels['version']}" if "version" in labels else ""]
    parts.append(labels.get("reason", ""))
    return " ".join(p for p in parts if p)


def _iso(at: datetime) -> str:
    return at.isoformat()


def figure(
    series: list[Series], *, unit: str, markers: list[Marker], start: datetime, end: datetime
) -> dict[str, Any]:
    """A Plotly figure spec (what plotly.js draws), written directly: building it through
    plotly.graph_objects validates every value and cost several times the Prometheus query
    itself (tests/bench/test_chart_overhead.py)."""
    colour = "#b45309"
    traces = [
        {
            "type": "scatter",
            "x": [int(t * 1000) for t in each.times],  # a date axis reads Unix milliseconds
            "y": each.values,
            "mode": "lines+markers",
            "marker": {"size": 4},
            "name": series_name(each.labels),
            "hovertemplate": "%{y:.3g} " + unit + "<br>%{x}<extra>%{fullData.name}</extra>",
        }
        for each in series
    ]
    shapes = [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": _iso(m.at),
            "x1": _iso(m.at),
            "y0": 0,
            "y1": 1,
            "line": {"dash": "dot", "color": colour, "width": 1.5},
        }
        for m in markers
    ]
    # Labels stand upright along their line so that close changes do not overwrite each other.
    annotations = [
        {
            "x": _iso(m.at),
            "y": 1,
            "xref": "x",
            "yref": "paper",
            "text": m.label or m.text,
            "hovertext": m.text,
            "showarrow": False,
            "textangle": -90,
            "xanchor": "right",
            "yanchor": "top",
            "font": {"size": 10, "color": colour},
        }
        for m in markers
    ]
    axis = {"gridcolor": "#eef0f3", "zerolinecolor": "#e4e7ec", "linecolor": "#e4e7ec"}
    layout = {
        "margin": {"l": 56, "r": 16, "t": 24, "b": 40},
        "height": 300,
        "paper_bgcolor": "#ffffff",
        "plot_bgcolor": "#ffffff",
        "font": {"family": "system-ui, DejaVu Sans, sans-serif", "size": 12, "color": "#344054"},
        "xaxis": {**axis, "type": "date", "range": [_iso(start), _iso(end)]},
        "yaxis": {**axis, "title": {"text": unit}},
        "showlegend": True,  # even for one series: the legend names the model and version
        "legend": {"orientation": "h", "y": -0.2},
        "shapes": shapes,
        "annotations": annotations,
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}


def metric_chart(
    key: str,
    *,
    start: datetime,
    end: datetime,
    model: str = "",
    pool: str = "",
    node: str = "",
) -> Chart:
    """One metric over [start, end], every change to `model` or `node` (or to anything, when
    neither is given) marked on it."""
    metric = METRICS[key]
    step = step_for((end - start).total_seconds())
    query = build_query(metric, model=model, pool=pool, node=node, window_s=max(30, 4 * step))
    try:
        series = range_query(query, start=start, end=end, step_s=step)
    except PrometheusUnavailable as exc:
        return Chart(title=metric.title, message=str(exc))
    # A summary quantile is NaN while a model gets no requests: such a series has nothing to draw.
    series = [s for s in series if any(v is not None for v in s.values)]
    if not series:
        return Chart(title=metric.title, message="No data in this range.")
    markers = change_markers(start=start, end=end, model=model, node=node)
    fig = figure(series, unit=metric.unit, markers=markers, start=start, end=end)
    # Escaped so that no label value can close the <script type="application/json"> it sits in.
    safe_json = (
        orjson.dumps(fig)
        .decode()
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )
    return Chart(title=metric.title, figure_json=safe_json)

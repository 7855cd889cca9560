"""Plotly figures from Prometheus series, with vertical markers for what changed."""

import math
from dataclasses import dataclass
from datetime import datetime

import plotly.graph_objects as go

from apps.observability.catalog import METRICS, build_query, step_for
from apps.observability.prometheus import PrometheusUnavailable, Series, range_query


@dataclass(frozen=True)
class Marker:
    at: datetime
    text: str  # the whole story, on hover
    label: str = ""  # a few words on the chart


@dataclass(frozen=True)
class Chart:
    title: str
    figure_json: str = ""
    message: str = ""  # shown instead of the figure: no data, Prometheus down...


def series_name(labels: dict[str, str]) -> str:
    if "model" not in labels and "node" in labels:  # memory: per node, and per GPU
        return " ".join(filter(None, [labels["node"], labels.get("gpu_uuid", "")]))
    parts = [labels.get("model", "all"), f"v{labels['version']}" if "version" in labels else ""]
    parts.append(labels.get("reason", ""))
    return " ".join(p for p in parts if p)


def figure(series: list[Series], *, unit: str, markers: list[Marker]) -> go.Figure:
    fig = go.Figure()
    for each in series:
        fig.add_trace(
            go.Scatter(
                x=each.times,
                y=each.values,
                mode="lines+markers",
                marker={"size": 4},
                name=series_name(each.labels),
                hovertemplate="%{y:.3g} " + unit + "<br>%{x}<extra>%{fullData.name}</extra>",
            )
        )
    for marker in markers:
        fig.add_vline(x=marker.at.timestamp() * 1000, line={"dash": "dot", "color": "#b45309"})
        # Labels stand upright along their line so that close changes do not overwrite each other.
        fig.add_annotation(
            x=marker.at,
            y=1,
            yref="paper",
            text=marker.label or marker.text,
            hovertext=marker.text,
            showarrow=False,
            textangle=-90,
            xanchor="right",
            yanchor="top",
            font={"size": 10, "color": "#b45309"},
        )
    fig.update_layout(
        margin={"l": 56, "r": 16, "t": 24, "b": 40},
        height=300,
        template="plotly_white",
        yaxis_title=unit,
        showlegend=True,  # even for one series: the legend names the model and version
        legend={"orientation": "h", "y": -0.2},
    )
    return fig


def metric_chart(
    key: str,
    *,
    start: datetime,
    end: datetime,
    model: str = "",
    pool: str = "",
    node: str = "",
    markers: list[Marker] | None = None,
) -> Chart:
    metric = METRICS[key]
    step = step_for((end - start).total_seconds())
    query = build_query(metric, model=model, pool=pool, node=node, window_s=max(30, 4 * step))
    try:
        series = range_query(query, start=start, end=end, step_s=step)
    except PrometheusUnavailable as exc:
        return Chart(title=metric.title, message=str(exc))
    # A summary quantile is NaN while a model gets no requests: such a series has nothing to draw.
    series = [s for s in series if any(not math.isnan(v) for v in s.values)]
    if not series:
        return Chart(title=metric.title, message="No data in this range.")
    fig = figure(series, unit=metric.unit, markers=markers or [])
    fig.update_xaxes(range=[start, end])  # the window asked for, even where data is missing
    # Escaped so that no label value can close the <script type="application/json"> it sits in.
    safe_json = (
        fig.to_json().replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    )
    return Chart(title=metric.title, figure_json=safe_json)

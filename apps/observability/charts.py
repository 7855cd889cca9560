"""Plotly figures from Prometheus series, with vertical markers for what changed."""

from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

import orjson
from django.utils.http import urlencode

from apps.observability.markers import Marker, change_markers
from apps.prometheus.catalog import METRICS, build_query, step_for
from apps.prometheus.client import PrometheusUnavailable, Series, range_query


@dataclass(frozen=True)
class Chart:
    title: str
    figure_json: str = ""
    message: str = ""  # shown instead of the figure: no data, Prometheus down...
    note: str = ""  # shown under the figure: how to read it
    window: str = ""  # its window and model as a query string: the timeline of what it shows


def series_name(labels: dict[str, str]) -> str:
    if "model" not in labels and "node" in labels:  # per node (and per GPU for memory)
        return " ".join(filter(None, [labels["node"], labels.get("gpu_uuid", "")]))
    parts = [labels.get("model", "all"), f"v{labels['version']}" if "version" in labels else ""]
    parts.append(labels.get("reason", ""))
    return " ".join(p for p in parts if p)


def _iso(at: datetime) -> str:
    return at.isoformat()


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


COLOURS = {"change": "#b45309", "operation": "#667085", "down": "#b42318", "up": "#067647"}
COLOURS["synthetic"] = "#6d28d9"  # requests a rollout made, not users
LABEL_ROWS = 3
LABEL_ROW_PX = 14
# Labels are laid out here, not measured in the browser: as if the plot were as narrow as any
# chart gets (the timeline's grid), so that they do not overlap on the widest either.
PLOT_PX = 480
CHAR_PX = 5.5  # system-ui at 10 px, on average
LABEL_CHARS = 28
HOVER_STORIES = 6


@dataclass
class Label:
    markers: list[Marker]
    row: int
    anchor: str  # the label's side at its line: left (it starts there) or right

    @property
    def text(self) -> str:
        first = self.markers[0].label or self.markers[0].text.split("\n", 1)[0]
        first = first if len(first) <= LABEL_CHARS else first[: LABEL_CHARS - 1] + "…"
        return first + (f" +{len(self.markers) - 1}" if len(self.markers) > 1 else "")


def place_labels(markers: list[Marker], *, start: datetime, end: datetime) -> list[Label]:
    """One label per marker, in the first row above the plot where it overlaps nothing; one
    with no room in any row joins the label before it (`deploy rag_pipeline v2 +3`)."""
    span = (end - start).total_seconds() or 1.0
    row_ends = [float("-inf")] * LABEL_ROWS  # in fractions of the plot's width
    labels: list[Label] = []
    for marker in markers:
        x = (marker.at - start).total_seconds() / span
        width = (min(len(marker.label or marker.text), LABEL_CHARS) + 4) * CHAR_PX / PLOT_PX
        # A label starts at its line, like a flag; near the right edge it ends there instead.
        anchor = "left" if x + width <= 1 else "right"
        left = x if anchor == "left" else x - width
        row = next((r for r, taken in enumerate(row_ends) if taken <= left), None)
        if row is None:  # never the first: every row is free then
            labels[-1].markers.append(marker)
            continue
        row_ends[row] = left + width
        labels.append(Label([marker], row, anchor))
    return labels


def _hover(markers: list[Marker]) -> str:
    """Stories for a hover box: Plotly reads its text as HTML, `<br>` breaking lines."""
    stories = [escape(m.text, quote=False).replace("\n", "<br>") for m in markers[:HOVER_STORIES]]
    if len(markers) > HOVER_STORIES:
        stories.append(f"… and {len(markers) - HOVER_STORIES} more changes")
    return "<br><br>".join(stories)


def _hover_trace(markers: list[Marker], series: list[Series]) -> dict[str, Any]:
    """Invisible points up each marker's line (at the bottom, middle and top of the data, so as
    not to stretch the axis) that tell the marker's story on hover."""
    values = [v for each in series for v in each.values if v is not None]
    low, high = min(values), max(values)
    heights = [low, (low + high) / 2, high]
    return {
        "type": "scatter",
        "mode": "markers",
        "x": [_ms(m.at) for m in markers for _ in heights],
        "y": heights * len(markers),
        "text": [_hover([m]) for m in markers for _ in heights],
        "marker": {"size": 10, "opacity": 0},
        "hovertemplate": "%{text}<extra>%{x|%H:%M:%S} UTC</extra>",
        "hoverlabel": {
            "align": "left",
            "bgcolor": [COLOURS[m.kind] for m in markers for _ in heights],
        },
        "name": "changes",
        "showlegend": False,
    }


def figure(
    series: list[Series], *, unit: str, markers: list[Marker], start: datetime, end: datetime
) -> dict[str, Any]:
    """A Plotly figure spec (what plotly.js draws), written directly: building it through
    plotly.graph_objects validates every value and cost several times the Prometheus query
    itself (tests/bench/test_chart_overhead.py)."""
    traces: list[dict[str, Any]] = [
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
    # Thin, faint and under the series: a line says when, its label above the plot says what,
    # and the whole story is on hover, over the line or over the label.
    shapes = [
        {
            "type": "line",
            "xref": "x",
            "yref": "paper",
            "x0": _ms(m.at),
            "x1": _ms(m.at),
            "y0": 0,
            "y1": 1,
            "layer": "below",
            "opacity": 0.5,
            "line": {"dash": "dot", "color": COLOURS[m.kind], "width": 1},
        }
        for m in markers
    ]
    if markers:
        traces.append(_hover_trace(markers, series))
    labels = place_labels(markers, start=start, end=end)
    annotations = [
        {
            "x": _ms(label.markers[0].at),
            "y": 1,
            "xref": "x",
            "yref": "paper",
            "yanchor": "bottom",
            "yshift": 2 + LABEL_ROW_PX * label.row,
            "xanchor": label.anchor,
            "textangle": 0,
            "text": escape(label.text, quote=False),
            "hovertext": _hover(label.markers),
            "showarrow": False,
            "font": {"size": 10, "color": COLOURS[label.markers[0].kind]},
        }
        for label in labels
    ]
    rows = max((label.row + 1 for label in labels), default=0)
    axis = {"gridcolor": "#eef0f3", "zerolinecolor": "#e4e7ec", "linecolor": "#e4e7ec"}
    layout = {
        "margin": {"l": 56, "r": 16, "t": 20 + LABEL_ROW_PX * rows, "b": 40},
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
    """One metric over [start, end], every change to `model`, `pool` or `node` (or to anything,
    when none is given) marked on it."""
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
    markers = change_markers(start=start, end=end, model=model, pool=pool, node=node)
    fig = figure(series, unit=metric.unit, markers=markers, start=start, end=end)
    window = {"start": f"{start:%Y-%m-%dT%H:%M:%S}", "end": f"{end:%Y-%m-%dT%H:%M:%S}"}
    window |= {"model": model} if model else {}
    return Chart(title=metric.title, figure_json=script_json(fig), window=urlencode(window))


def script_json(fig: dict[str, Any]) -> str:
    """The figure as JSON escaped so that no label can close the <script> element it sits in."""
    text = orjson.dumps(fig).decode()
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def distributions(title: str, sides: dict[str, list[float]], *, unit: str, note: str) -> Chart:
    """Samples side by side, each as a box with its points: what a statistical verdict saw."""
    if not any(sides.values()):
        return Chart(title=title, message="No samples.")
    fig = {
        "data": [
            {
                "type": "box",
                "name": name,
                "x": values,
                "boxpoints": "all",
                "jitter": 0.4,
                "orientation": "h",
                "marker": {"size": 5},
                "hovertemplate": f"%{{x:.4g}} {unit}<extra>{name}</extra>",
            }
            for name, values in sides.items()
        ],
        "layout": {
            "height": 170,
            "margin": {"l": 70, "r": 10, "t": 10, "b": 30},
            "showlegend": False,
            "xaxis": {"title": {"text": unit}, "zeroline": False},
            "paper_bgcolor": "rgba(0,0,0,0)",
            "plot_bgcolor": "rgba(0,0,0,0)",
        },
    }
    return Chart(title=title, figure_json=script_json(fig), note=note)


def curves(
    title: str, lines: dict[str, list[tuple[float, float, str]]], *, x: str, y: str, note: str
) -> Chart:
    """Lines of points (x, y, the point's label), each named: a latency-throughput curve per
    measurement, the label its concurrency."""
    if not any(lines.values()):
        return Chart(title=title, message="No figures yet.")
    fig = {
        "data": [
            {
                "type": "scatter",
                "mode": "lines+markers+text",
                "name": name,
                "x": [p[0] for p in points],
                "y": [p[1] for p in points],
                "text": [p[2] for p in points],
                "textposition": "top left",
                "hovertemplate": f"%{{x:.4g}} {x}, %{{y:.4g}} {y} (%{{text}})<extra>{name}</extra>",
            }
            for name, points in lines.items()
        ],
        "layout": {
            "height": 300,
            "margin": {"l": 60, "r": 10, "t": 10, "b": 40},
            "legend": {"orientation": "h", "y": -0.25},
            "xaxis": {"title": {"text": x}, "rangemode": "tozero"},
            "yaxis": {"title": {"text": y}, "rangemode": "tozero"},
            "paper_bgcolor": "rgba(0,0,0,0)",
            "plot_bgcolor": "rgba(0,0,0,0)",
        },
    }
    return Chart(title=title, figure_json=script_json(fig), note=note)

"""Layout of an ensemble as a left-to-right graph, drawn as SVG by the template: ensemble inputs,
then each step in the column after its latest producer, then ensemble outputs; edges carry tensor
names."""

from dataclasses import dataclass
from typing import Any

BOX_W, BOX_H, GAP_X, GAP_Y, PAD, LANE = 170, 58, 90, 26, 20, 28


@dataclass(frozen=True)
class Box:
    key: str
    title: str
    subtitle: str
    kind: str  # input, step, output
    x: int
    y: int
    w: int = BOX_W
    h: int = BOX_H


@dataclass(frozen=True)
class Edge:
    tensor: str
    path: str
    label_x: int
    label_y: int


@dataclass(frozen=True)
class Graph:
    boxes: list[Box]
    edges: list[Edge]
    width: int
    height: int


def ensemble_graph(config: Any, budgets: dict[str, int | None]) -> Graph:
    producer: dict[str, str] = {t.name: f"in:{t.name}" for t in config.input}
    column: dict[str, int] = {f"in:{t.name}": 0 for t in config.input}
    steps = list(enumerate(config.ensemble_scheduling.step))
    for index, step in steps:
        for tensor in step.output_map.values():
            producer[tensor] = f"step:{index}"
    # Longest path from the inputs; bounded by the number of steps, so a cycle cannot loop forever.
    for _ in steps:
        for index, step in steps:
            sources = [producer.get(t) for t in step.input_map.values()]
            column[f"step:{index}"] = 1 + max((column.get(s or "", 0) for s in sources), default=0)
    last = max(column.values(), default=0) + 1
    for tensor in config.output:
        column[f"out:{tensor.name}"] = last

    titles = {f"in:{t.name}": (t.name, "ensemble input", "input") for t in config.input}
    for index, step in steps:
        budget = budgets.get(step.model_name)
        version = "latest" if step.model_version == -1 else f"v{step.model_version}"
        subtitle = f"{version} · budget {budget} ms" if budget else version
        titles[f"step:{index}"] = (step.model_name, subtitle, "step")
    titles |= {f"out:{t.name}": (t.name, "ensemble output", "output") for t in config.output}

    rows: dict[int, int] = {}
    boxes: dict[str, Box] = {}
    for key, col in sorted(column.items(), key=lambda item: (item[1], item[0])):
        row = rows.get(col, 0)
        rows[col] = row + 1
        title, subtitle, kind = titles[key]
        x, y = PAD + col * (BOX_W + GAP_X), PAD + LANE + row * (BOX_H + GAP_Y)
        boxes[key] = Box(key, title, subtitle, kind, x, y)

    edges = []
    for index, step in steps:
        for tensor in step.input_map.values():
            if tensor in producer:
                edges.append(_edge(tensor, boxes[producer[tensor]], boxes[f"step:{index}"]))
    for tensor in config.output:
        if tensor.name in producer:
            edges.append(
                _edge(tensor.name, boxes[producer[tensor.name]], boxes[f"out:{tensor.name}"])
            )
    width = PAD * 2 + (last + 1) * (BOX_W + GAP_X) - GAP_X
    height = PAD * 2 + LANE + max(rows.values(), default=1) * (BOX_H + GAP_Y) - GAP_Y
    return Graph(list(boxes.values()), edges, width, height)


def _edge(tensor: str, source: Box, target: Box) -> Edge:
    x1, y1 = source.x + source.w, source.y + source.h // 2
    x2, y2 = target.x, target.y + target.h // 2
    if x2 <= x1:  # a back edge (only in a broken ensemble): route it below the boxes
        below = max(source.y, target.y) + BOX_H + GAP_Y // 2
        path = f"M{x1},{y1} C{x1 + 40},{below} {x2 - 40},{below} {x2},{y2}"
        return Edge(tensor, path, (x1 + x2) // 2, below)
    if x2 - x1 > GAP_X:  # skips a column: ride the lane above the boxes it passes
        lane = PAD + LANE // 2
        path = (
            f"M{x1},{y1} C{x1 + 40},{y1} {x1 + 20},{lane} {x1 + 60},{lane} "
            f"L{x2 - 60},{lane} C{x2 - 20},{lane} {x2 - 40},{y2} {x2},{y2}"
        )
        return Edge(tensor, path, (x1 + x2) // 2, lane - 5)
    mid = (x1 + x2) // 2
    return Edge(tensor, f"M{x1},{y1} C{mid},{y1} {mid},{y2} {x2},{y2}", mid, (y1 + y2) // 2 - 6)

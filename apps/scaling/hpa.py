"""A Kubernetes HorizontalPodAutoscaler's arithmetic (autoscaling/v2, pkg/controller/podautoscaler),
for what follows the product's signal outside a cluster: the demo's fleet tooling, and the tests
that check an HPA on `controlplane_pool_nodes_wanted` asks for the nodes the product wants.

The chart's HPA reads the signal as an External metric with an AverageValue target of 1 node: the
replicas it wants are the metric's value, unless the value is within the tolerance of the replicas
there are; a scale-down takes the highest recommendation of its stabilization window; a scale-up
is limited by its policies (by default the larger of doubling and 4 pods per 15 s)."""

import math
from collections import deque
from dataclasses import dataclass, field

TOLERANCE = 0.1  # the controller's --horizontal-pod-autoscaler-tolerance default


def external_average_value(
    *, current: int, value: float, target: float = 1.0, tolerance: float = TOLERANCE
) -> int:
    """GetExternalMetricReplicas: `value` summed over the selected series, `target` a replica's
    share of it. The chart sets the tolerance to 0 (behavior.*.tolerance, Kubernetes 1.33 and
    later): the signal has applied its own to the readings it is made of."""
    if current == 0:
        return math.ceil(value / target)
    usage_ratio = value / (target * current)
    if abs(1.0 - usage_ratio) <= tolerance:
        return current
    return math.ceil(value / target)


@dataclass
class Autoscaler:
    """One HPA over time: `recommend` is called at each sync (15 s in a cluster) with the metric's
    value, and answers the replicas to set now."""

    least: int
    most: int
    scale_down_window_s: float = 300.0
    scale_up_window_s: float = 0.0
    tolerance: float = TOLERANCE
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def recommend(self, *, now: float, current: int, value: float) -> int:
        desired = external_average_value(current=current, value=value, tolerance=self.tolerance)
        up, down = desired, desired
        for at, recommendation in self._history:
            if at > now - self.scale_up_window_s:
                up = min(up, recommendation)
            if at > now - self.scale_down_window_s:
                down = max(down, recommendation)
        while self._history and self._history[0][0] <= now - self.scale_down_window_s:
            self._history.popleft()
        self._history.append((now, desired))
        stabilized = min(max(current, up), down)
        if stabilized > current:  # the default scale-up policies, per period
            stabilized = min(stabilized, max(2 * current, current + 4))
        return min(max(stabilized, self.least), self.most)

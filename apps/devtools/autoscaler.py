"""The local fleet scaled as a cluster scales a pool: every period the pool's count from the
product's signal (the `Scaling` row the tick writes, the value `controlplane_pool_nodes_wanted`
exports) goes through a HorizontalPodAutoscaler's arithmetic and stabilization window
(apps/scaling/hpa.py, the chart's behaviour); nodes are started (discovery finds them; they join
out of traffic until warm) or let go in the order the product gives (out of traffic first, never
a running rollout's canary), each drained before it stops: its target unlisted, discovery's next
pass takes its weight to 0, the balancer reads it back, then SIGTERM."""

import time
from collections.abc import Callable
from dataclasses import dataclass

from apps.devtools import targets
from apps.devtools.devfleet import Devfleet
from apps.fleet.models import Node, NodePool
from apps.scaling.hpa import Autoscaler
from apps.scaling.models import Scaling
from apps.scaling.selectors import scale_in_order


@dataclass
class Follower:
    devfleet: Devfleet
    pool: str
    scaler: Autoscaler
    drain_timeout_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def step(self, now: float) -> str:
        """One sync: what it did, in words."""
        listed = self.listed()
        wanted = Scaling.objects.filter(pool__name=self.pool).values_list("wanted", flat=True)
        value = wanted.first()
        if value is None:
            return f"{self.pool}: no signal yet; {len(listed)} nodes"
        target = self.scaler.recommend(now=now, current=len(listed), value=value)
        if target > len(listed):
            started = [self.devfleet.add_node(self.pool).name for _ in range(target - len(listed))]
            return f"{self.pool}: {value} wanted, {len(listed)} -> {target}: started {started}"
        if target < len(listed):
            pool = NodePool.objects.get(name=self.pool)
            order = [n for n in scale_in_order(pool).values_list("name", flat=True) if n in listed]
            going = order[: len(listed) - target]
            for name in going:
                self._let_go(name)
            return f"{self.pool}: {value} wanted, {len(listed)} -> {target}: let go {going}"
        return f"{self.pool}: {value} wanted, {len(listed)} nodes: steady"

    def listed(self) -> list[str]:
        """The pool's nodes listed for Prometheus (the local fleet's replicas), in order."""
        return targets.listed(self.devfleet.targets, self.pool)

    def _let_go(self, name: str) -> None:
        self.devfleet.unlist(name)
        deadline = time.monotonic() + self.drain_timeout_s
        while time.monotonic() < deadline:
            node = Node.objects.filter(name=name).values("unlisted_since", "served_weight").first()
            if node is None or (node["unlisted_since"] and not node["served_weight"]):
                break
            self.sleep(0.5)
        self.devfleet.stop(name)

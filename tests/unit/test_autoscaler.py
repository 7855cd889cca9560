"""The local fleet's autoscaler, its processes stubbed (tests/integration/test_autoscaling.py
starts real nodes): it follows the product's count through an HPA's arithmetic, starts what is
missing, and lets nodes go in the product's order, each drained before it stops."""

from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from apps.devtools import targets
from apps.devtools.autoscaler import Follower
from apps.devtools.processes import Proc
from apps.fleet.models import Node, NodePool
from apps.scaling.hpa import Autoscaler
from apps.scaling.models import Scaling

pytestmark = pytest.mark.django_db


class Fleet:
    """The Devfleet calls the autoscaler makes, on a targets file; unlisting a node does what
    discovery's next pass and the balancer then do (its weight 0, read back)."""

    def __init__(self, home: Path, pool: NodePool) -> None:
        self.targets, self.pool = home / "nodes.yml", pool
        self.calls: list[str] = []
        self.targets.write_text("")
        for name in ("p-1", "p-2", "p-3"):
            self._list(name)

    def _list(self, name: str) -> None:
        Node.objects.create(name=name, pool=self.pool, http_url="http://127.0.0.1:1")
        ports = {"http": 1, "grpc": 2, "metrics": 3}
        targets.add(
            self.targets, Proc(name, pid=0, argv=[], log="", started=0, ports=ports), self.pool.name
        )

    def add_node(self, pool: str) -> Any:
        name = f"p-{Node.objects.count() + 1}"
        self._list(name)
        self.calls.append(f"add {name}")
        return type("Proc", (), {"name": name})

    def unlist(self, name: str) -> None:
        targets.drop(self.targets, name)
        Node.objects.filter(name=name).update(unlisted_since=timezone.now(), served_weight=0)
        self.calls.append(f"unlist {name}")

    def stop(self, name: str) -> None:
        assert Node.objects.get(name=name).served_weight == 0  # drained first
        self.calls.append(f"stop {name}")


def test_it_starts_what_the_signal_wants_and_lets_go_drained_first_after_its_window(
    tmp_path: Path,
) -> None:
    pool = NodePool.objects.create(name="p")
    fleet = Fleet(tmp_path, pool)
    scaler = Autoscaler(least=1, most=4, scale_down_window_s=60, tolerance=0)
    follower = Follower(fleet, "p", scaler, sleep=lambda s: None)  # type: ignore[arg-type]
    assert follower.step(0) == "p: no signal yet; 3 nodes"

    Scaling.objects.create(pool=pool, wanted=6)
    assert follower.step(1) == "p: 6 wanted, 3 -> 4: started ['p-4']"  # at most 4
    assert follower.listed() == ["p-1", "p-2", "p-3", "p-4"]

    Scaling.objects.filter(pool=pool).update(wanted=2)
    Node.objects.filter(name="p-2").update(draining=True)  # out of traffic already
    assert follower.step(30) == "p: 2 wanted, 4 nodes: steady"  # 6 was asked 29 s ago
    assert follower.step(62) == "p: 2 wanted, 4 -> 2: let go ['p-2', 'p-4']"
    assert fleet.calls == ["add p-4", "unlist p-2", "stop p-2", "unlist p-4", "stop p-4"]
    assert follower.listed() == ["p-1", "p-3"]

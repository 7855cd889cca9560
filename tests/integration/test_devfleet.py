"""The local fleet's processes: ports, and a stop that takes only what it started, all at once."""

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from apps.devtools import devfleet
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import DevfleetError, FleetState, PortTaken, Proc, listens, ports_free
from tests.support import REPOSITORY
from tests.support.fleet import wait_for

pytestmark = pytest.mark.integration


def test_a_taken_port_is_a_one_line_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        with pytest.raises(DevfleetError, match=f"port {taken} is already taken; pick other ports"):
            ports_free(1, taken)


def test_down_never_kills_a_process_it_did_not_start(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
        # A state file whose pid was reused by another program: same pid, other command line.
        fleet._save(
            FleetState(
                nodes=[
                    Proc(name="demo-1", pid=stranger.pid, argv=["tritonserver"], log="", started=0)
                ]
            )
        )
        assert fleet.down() == [f"demo-1: not running (pid {stranger.pid})"]
        assert stranger.poll() is None
        assert not (tmp_path / "state.json").exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_down_stops_what_it_started(tmp_path: Path) -> None:
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    proc = fleet._spawn("sleeper", ["sleep", "30"], {})
    fleet._save(FleetState(nodes=[proc]))
    assert proc.running
    assert fleet.down() == [f"sleeper: stopped (pid {proc.pid})"]
    assert not proc.running


STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ignoring SIGTERM', flush=True); time.sleep(60)"
)


def test_down_stops_every_process_at_once_and_kills_what_lingers(tmp_path: Path) -> None:
    """Ctrl-C on `make demo`: what ignores SIGTERM is killed after the grace, and the grace is
    counted once for the whole fleet, not once per process."""
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    procs = [fleet._spawn(f"node-{n}", ["python3", "-c", STUBBORN], {}) for n in (1, 2, 3)]
    fleet._save(FleetState(nodes=procs))
    logs = [Path(proc.log) for proc in procs]
    # Each has its handler: a SIGTERM before it would simply end it.
    wait_for("each ignores SIGTERM", lambda: all("ignoring" in log.read_text() for log in logs), 10)
    started = time.monotonic()
    lines = fleet.down(grace_s=1.0)
    took = time.monotonic() - started
    assert lines == [f"{p.name}: killed after 1 s (pid {p.pid})" for p in procs]
    assert not any(p.running for p in procs)
    assert took < 3.0, took  # 1 s of grace for all three, not 3 s: stopped together


def test_missing_prometheus_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no prometheus on this PATH
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    with pytest.raises(
        DevfleetError, match=r"`prometheus` is not installed: apt-get install -y prometheus"
    ):
        fleet.up(nodes=1, pool="t", base_port=None, prometheus_port=None)


def test_missing_stub_is_a_one_line_command_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("apps.devtools.devfleet.PYTHON_VERSION", "3.99")
    with pytest.raises(CommandError, match=r"no Python backend stub for Python 3\.99"):
        call_command("devfleet", "--home", str(tmp_path), "up", "--nodes", "1", "--base-port", "0")


def test_load_of_an_unknown_version_names_what_exists(tmp_path: Path) -> None:
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    with pytest.raises(
        DevfleetError,
        match=r"rag_pipeline has no version 99 .* \(has \[1, 2, 3, .*, 13, 14\]\)",
    ):
        fleet.load_release(None, "rag_pipeline", 99)  # type: ignore[arg-type]


LISTENER = (
    "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
    "s.listen(); print('listening', flush=True); time.sleep(60)"
)


def test_a_process_listens_only_on_ports_it_holds_itself(tmp_path: Path) -> None:
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    mine, other = ports_free(2, None)
    with socket.socket() as held_here:
        held_here.bind(("127.0.0.1", other))
        held_here.listen()
        proc = fleet._spawn("listener", ["python3", "-c", LISTENER, str(mine)], {"http": mine})
        fleet._save(FleetState(nodes=[proc]))
        try:
            wait_for("it listens", lambda: "listening" in Path(proc.log).read_text(), 10)
            assert listens(proc)
            # The other port answers too, but from this test's socket, not from the process.
            assert not listens(Proc(**{**proc.__dict__, "ports": {"http": mine, "x": other}}))
        finally:
            fleet.down()


@pytest.fixture
def taken_metrics_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list[list[int]]]]:
    """A port held by this test, named as its metrics port by the first pick of a node's three
    ports, as if another process had bound it between the pick and tritonserver's start; later
    picks are free. Yields the port and the picks made."""
    picks: list[list[int]] = []
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = thief.getsockname()[1]

        def pick(count: int, base: int | None) -> list[int]:
            ports = ports_free(count, None)
            if not picks and count == 3:
                ports[2] = taken
            picks.append(ports)
            return ports

        monkeypatch.setattr(devfleet, "ports_free", pick)
        yield taken, picks


def test_a_node_whose_port_was_taken_after_the_pick_starts_on_new_ones(
    tmp_path: Path, taken_metrics_port: tuple[int, list[list[int]]]
) -> None:
    taken, picks = taken_metrics_port
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    state = fleet.up(nodes=1, pool="t", base_port=None, prometheus_port=None)
    try:
        (node,) = state.nodes
        assert picks[0][2] == taken and node.ports["metrics"] != taken
        assert listens(node) and fleet.state().nodes == [node]
    finally:
        fleet.down()


def test_a_taken_port_given_by_the_user_is_not_replaced(
    tmp_path: Path, taken_metrics_port: tuple[int, list[list[int]]]
) -> None:
    taken, _ = taken_metrics_port
    fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
    with pytest.raises(PortTaken, match=f"t-1 exited during start-up.*'127.0.0.1:{taken}'"):
        fleet.up(nodes=1, pool="t", base_port=20000, prometheus_port=None)
    assert fleet.state().processes == []


def test_prometheus_and_haproxy_whose_ports_were_taken_after_the_pick_start_on_new_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free ports are picked, then bound by the process seconds later: another process (an
    outgoing connection's ephemeral port, say) may take one meanwhile, as CI once saw of
    Prometheus's. The first pick of each is a port this test holds."""
    stolen: list[str] = []
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        taken = thief.getsockname()[1]

        def pick(count: int, base: int | None) -> list[int]:
            ports = ports_free(count, None)
            victim = "prometheus" if count == 1 else "haproxy" if fleet.state().prometheus else ""
            if victim and victim not in stolen:
                stolen.append(victim)
                ports[0] = taken
            return ports

        monkeypatch.setattr(devfleet, "ports_free", pick)
        fleet = Devfleet(home=tmp_path, repository=REPOSITORY)
        state = fleet.up(nodes=1, pool="t", base_port=None, prometheus_port=None)
        try:
            balancer = fleet.balancer()
            assert stolen == ["prometheus", "haproxy"]
            assert state.prometheus is not None and state.prometheus.ports["web"] != taken
            assert listens(state.prometheus) and balancer.ports["http"] != taken
            assert listens(balancer)
        finally:
            fleet.down()

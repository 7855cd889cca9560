"""The local fleet's processes as recorded (`Proc`, `FleetState`), and what starting and
stopping them needs: free ports, each kind's environment, waiting until one answers or is gone,
and HAProxy's configuration in front of the nodes. It imports no Django: `python -m
apps.devtools.processes down HOME` stops a fleet at once, without starting the project."""

import argparse
import json
import os
import shutil
import signal
import socket
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from apps.fleet.traffic.haproxy import HEALTH_CHECKS

START_TIMEOUT_S = 60.0
PROJECT_ROOT = Path(__file__).resolve().parents[2]
HAPROXY_BACKENDS = ("triton_http", "triton_grpc")
# As a pool names them: the gRPC backend's servers are the nodes' gRPC endpoints.
POOL_BACKENDS = ("triton_http", "triton_grpc:grpc")
SINGLE_PROCESSES = ("prometheus", "simulator", "alertmanager", "haproxy")


class DevfleetError(Exception):
    """Something the user must fix; the message says what and how, in one line."""


class PortTaken(DevfleetError):
    """A process exited during start-up because another one held one of its ports."""


@dataclass
class Proc:
    name: str
    pid: int
    argv: list[str]
    log: str
    started: int  # start time in clock ticks since boot: with the pid, identifies the process
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        """True only while `pid` is still the process we started, and not a zombie."""
        stat = proc_stat(self.pid)
        return stat is not None and stat[0] != "Z" and int(stat[19]) == self.started


@dataclass
class FleetState:
    nodes: list[Proc] = field(default_factory=list)
    prometheus: Proc | None = None
    simulator: Proc | None = None  # its ports: one per simulated node, by node name
    alertmanager: Proc | None = None
    haproxy: Proc | None = None  # in front of the nodes: ports http, grpc and runtime (its API)

    def node_urls(self, node: Proc) -> dict[str, str]:
        return {
            "http_url": f"http://127.0.0.1:{node.ports['http']}",
            "grpc_url": f"127.0.0.1:{node.ports['grpc']}",
            "metrics_url": f"http://127.0.0.1:{node.ports['metrics']}/metrics",
        }

    def simulated_urls(self) -> dict[str, dict[str, str]]:
        """Each simulated node's addresses, by name; it serves /metrics on its HTTP port."""
        assert self.simulator is not None
        return {
            name: {
                "http_url": f"http://127.0.0.1:{port}",
                "grpc_url": "",
                "metrics_url": f"http://127.0.0.1:{port}/metrics",
            }
            for name, port in self.simulator.ports.items()
        }

    @classmethod
    def read(cls, path: Path) -> "FleetState":
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        one = {name: raw.get(name) for name in SINGLE_PROCESSES}
        return cls(
            nodes=[Proc(**node) for node in raw["nodes"]],
            **{name: Proc(**proc) if proc else None for name, proc in one.items()},  # type: ignore[arg-type]
        )

    def write(self, path: Path) -> None:
        data: dict[str, object] = {"nodes": [asdict(n) for n in self.nodes]}
        for name in SINGLE_PROCESSES:
            proc = getattr(self, name)
            data[name] = asdict(proc) if proc else None
        path.write_text(json.dumps(data, indent=2))

    @property
    def processes(self) -> list[Proc]:
        """Everything this fleet started: the nodes, the simulator, Prometheus, Alertmanager."""
        started = (self.simulator, self.prometheus, self.alertmanager, self.haproxy)
        extra = [proc for proc in started if proc is not None]
        return [*self.nodes, *extra]

    @property
    def prometheus_url(self) -> str:
        assert self.prometheus is not None
        return f"http://127.0.0.1:{self.prometheus.ports['web']}"


# A request whose node is stopping (a pod scaled away: refused connections, or Triton's 503 once
# its models unload) is sent again to another node: Triton ran none of it.
RETRIES = ("option redispatch 1", "retries 3", "retry-on conn-failure empty-response 503")


def haproxy_config(state: FleetState, *, http: int, grpc: int, runtime: int) -> str:
    """What `deploy/haproxy/triton-pool.cfg` shows, for the fleet's nodes on this machine."""
    # A gRPC server's health is checked over HTTP/1.1 on its node's HTTP port.
    grpc_check = "proto h2 check check-proto h1 port"
    servers = {
        "triton_http": [f"{n.name} 127.0.0.1:{n.ports['http']} check" for n in state.nodes],
        "triton_grpc": [
            f"{n.name} 127.0.0.1:{n.ports['grpc']} {grpc_check} {n.ports['http']}"
            for n in state.nodes
        ],
    }
    lines = [
        "global",
        f"    stats socket ipv4@127.0.0.1:{runtime} level admin",
        "defaults",
        "    mode http",
        "    timeout connect 2s",
        "    timeout client 60s",
        "    timeout server 60s",
        *(f"    {line}" for line in RETRIES),
        "frontend triton_http",
        f"    bind 127.0.0.1:{http}",
        "    default_backend triton_http",
        "frontend triton_grpc",
        f"    bind 127.0.0.1:{grpc} proto h2",
        "    default_backend triton_grpc",
    ]
    for backend in HAPROXY_BACKENDS:
        lines += [
            f"backend {backend}",
            "    balance roundrobin",
            "    option httpchk GET /v2/health/ready",
            f"    default-server weight 100 {HEALTH_CHECKS}",
            *(f"    server {server}" for server in servers[backend]),
        ]
    return "\n".join(lines) + "\n"


# What would make the Python backend's stub, which embeds the system's libpython3.11, look for
# its standard library and packages somewhere else than the system Python's.
_FOREIGN_PYTHON = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "CONDA_PREFIX")


def triton_env() -> dict[str, str]:
    """tritonserver finds its bundled libraries (libtritonserver, libcudart...) next to pytriton.
    The Python backend's stub embeds the system's libpython3.11, which takes its prefix from the
    first python3 on PATH: /usr/bin goes first, so the stub finds the system's numpy whatever
    the caller's shell put there (pyenv, conda, a virtualenv)."""
    import pytriton  # here: stopping a fleet needs none of it, and it takes a while to import

    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    env = {k: v for k, v in os.environ.items() if k not in _FOREIGN_PYTHON}
    path = "/usr/bin:" + env.get("PATH", "")
    return {**env, "LD_LIBRARY_PATH": str(libs), "PATH": path}


def simulator_env() -> dict[str, str]:
    """`python -m apps.devtools.simulator` finds the project wherever the command was started."""
    return {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}


def proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def require_binary(name: str, install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise DevfleetError(f"`{name}` is not installed: {install}")
    return path


def ports_free(count: int, base: int | None) -> list[int]:
    """`count` ports: consecutive from `base` (each checked free), or free ones the OS picks."""
    if base is None:
        sockets = [socket.socket() for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        ports = [sock.getsockname()[1] for sock in sockets]
        for sock in sockets:
            sock.close()
        return ports
    ports = list(range(base, base + count))
    for port in ports:
        with socket.socket() as sock:
            # Like the servers themselves, ignore TIME_WAIT left by a fleet that just stopped.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                raise DevfleetError(
                    f"port {port} is already taken; pick other ports with --base-port"
                ) from None
    return ports


def wait_http(url: str, proc: Proc) -> None:
    """Until `proc` answers `url` with 200 and listens on each of its ports itself. Answering
    is not enough: a port picked free may be taken before `proc` binds it, by a process that
    answers too (`proc` then exits); and a tritonserver serves HTTP before it binds its metrics
    port, and exits if that one is taken (a load sent in between sees its connection closed)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    answered = False
    while time.monotonic() < deadline:
        _require_running(proc)
        if answered and listens(proc):
            return
        try:
            with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - our own localhost URL
                answered = response.status == 200
        except OSError:
            pass
        time.sleep(0.05 if answered else 0.2)
    raise DevfleetError(
        f"{proc.name} did not answer {url} and listen on {sorted(proc.ports.values())} within "
        f"{START_TIMEOUT_S:.0f} s; see {proc.log}"
    )


def _require_running(proc: Proc) -> None:
    if proc.running:
        return
    lines = Path(proc.log).read_text(errors="replace").strip().splitlines()
    if taken := [line for line in lines if "already in use" in line]:
        # tritonserver logs its shutdown after the reason (verbosely in the fleet's nodes)
        raise PortTaken(f"{proc.name} exited during start-up: {taken[0]} (see {proc.log})")
    raise DevfleetError(
        f"{proc.name} exited during start-up; {proc.log} ends with: {' | '.join(lines[-3:])}"
    )


def listens(proc: Proc) -> bool:
    """Whether `proc` itself holds a listening socket on each of its ports, rather than some
    other process answering on one of them."""
    try:
        held = held_sockets(proc.pid)
    except OSError:  # gone, or a descriptor closed while listed: the caller looks again
        return False
    return set(proc.ports.values()) <= tcp_ports(held, listening=True)


def held_sockets(pid: int) -> set[str]:
    """The sockets process `pid` holds, as its /proc fd links name them ("socket:[inode]")."""
    return {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}


def tcp_ports(sockets: set[str], *, listening: bool) -> set[int]:
    """The local ports of the TCP sockets among `sockets` (`held_sockets`); with `listening`,
    of those that listen only."""
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()  # sl, local address, remote, state ("0A": LISTEN)... inode
            if f"socket:[{fields[9]}]" in sockets and (fields[3] == "0A" or not listening):
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def wait_simulator(proc: Proc) -> None:
    """The simulator binds its ports in order and serves each at once: the last one answering
    means every node does."""
    last = list(proc.ports.values())[-1]
    wait_http(f"http://127.0.0.1:{last}/v2/health/live", proc)


def wait_gone(proc: Proc, timeout: float) -> bool:
    """Whether `proc` is gone, looked at until `timeout` (once at least, however short)."""
    deadline = time.monotonic() + timeout
    while proc.running:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop(processes: list[Proc], grace_s: float) -> list[str]:
    """Stop `processes`, every one at once: SIGTERM to each still running as recorded (never
    a process that reused a recorded pid), then SIGKILL to what has not exited within
    `grace_s`. Returns one line per process saying what happened."""
    running = [proc for proc in processes if proc.running]
    lines = [f"{p.name}: not running (pid {p.pid})" for p in processes if p not in running]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        if wait_gone(proc, deadline - time.monotonic()):
            lines.append(f"{proc.name}: stopped (pid {proc.pid})")
            continue
        os.killpg(proc.pid, signal.SIGKILL)
        wait_gone(proc, 5.0)
        lines.append(f"{proc.name}: killed after {grace_s:g} s (pid {proc.pid})")
    return lines


def write_whole(path: Path, text: str) -> None:
    """`path` replaced at once, never seen half-written by whoever reads it (Prometheus' file_sd,
    the demo models' fault file); the partial file's name matches neither's pattern."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Stop a local fleet at once (`devfleet down`).")
    parser.add_argument("action", choices=["down"])
    parser.add_argument("home", type=Path, help="the fleet's home, where state.json is")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds before SIGKILL")
    args = parser.parse_args()
    state_file = args.home / "state.json"
    for line in stop(FleetState.read(state_file).processes, args.grace) or ["nothing to stop"]:
        print(line)
    state_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

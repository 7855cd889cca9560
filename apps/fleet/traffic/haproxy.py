"""HAProxy's runtime API (its stats socket, over TCP or a unix socket): server weights set and
read back, servers added or moved as nodes come, and the requests a server is still answering.
One connection per call, in HAProxy's non-interactive mode: commands separated by `;`, the
answer read until HAProxy closes."""

import csv
import io
import re
import socket
from dataclasses import dataclass

TIMEOUT_S = 3.0
# What a backend or server name may hold: a name is written into the runtime API's command line,
# where a space, `;` or a newline would start another command (`set server ... state maint`).
NAME = re.compile(r"[A-Za-z0-9._-]{1,60}")
# A server added at run time: its address and options, words of these characters only.
SERVER_LINE = re.compile(r"[A-Za-z0-9.:\[\]_ -]{1,200}")
# How a node's server is health-checked, added at run time as in the shipped configuration
# (deploy/haproxy/triton-pool.cfg): a runtime `add server` takes no `default-server` line.
HEALTH_CHECKS = "inter 1s fall 2 rise 1"


@dataclass(frozen=True)
class Server:
    weight: int
    address: str  # host:port, as HAProxy shows it


def name_refusal(name: str, *, what: str = "name") -> str:
    """Why `name` may not be sent to HAProxy's runtime API, or "" when it may."""
    if NAME.fullmatch(name):
        return ""
    return f"{what} {name!r}: only letters, digits, '.', '_' and '-' (at most 60)"


class HAProxyError(Exception):
    """The runtime API did not answer, or refused a command; says which address and why."""


class Runtime:
    def __init__(self, address: str, *, timeout: float = TIMEOUT_S) -> None:
        self.address = address
        self.timeout = timeout

    def _connect(self) -> socket.socket:
        if self.address.startswith(("/", "unix:")):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: str | tuple[str, int] = self.address.removeprefix("unix:")
        else:
            host, _, port = self.address.rpartition(":")
            if not host or not port.isdigit():
                raise HAProxyError(f"{self.address!r} is neither host:port nor a socket path")
            sock, target = socket.socket(), (host, int(port))
        sock.settimeout(self.timeout)
        try:
            sock.connect(target)
        except OSError as exc:
            sock.close()
            raise HAProxyError(f"HAProxy runtime API at {self.address}: {exc}") from None
        return sock

    def command(self, *commands: str) -> str:
        for command in commands:
            if any(c in command for c in ";\r\n"):
                raise HAProxyError(f"HAProxy at {self.address}: refused to send {command!r}")
        with self._connect() as sock:
            try:
                sock.sendall(("; ".join(commands) + "\n").encode())
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            except OSError as exc:
                raise HAProxyError(f"HAProxy runtime API at {self.address}: {exc}") from None
        return b"".join(chunks).decode(errors="replace")

    def servers(self, backend: str) -> dict[str, "Server"]:
        """Each server of `backend`, by name: its weight and address now."""
        _check(backend, "backend")
        answer = self.command(f"show servers state {backend}")
        lines = [line for line in answer.splitlines() if line.strip()]
        header = next((line for line in lines if line.startswith("# be_id")), None)
        if header is None:
            raise HAProxyError(f"HAProxy at {self.address}, backend {backend}: {answer.strip()}")
        columns = header[2:].split()
        name, weight = columns.index("srv_name"), columns.index("srv_uweight")
        addr, port = columns.index("srv_addr"), columns.index("srv_port")
        rows = [line.split() for line in lines if line[0].isdigit() and " " in line]
        return {row[name]: Server(int(row[weight]), f"{row[addr]}:{row[port]}") for row in rows}

    def weights(self, backend: str) -> dict[str, int]:
        """Each server of `backend`, by name, with its current weight."""
        return {name: server.weight for name, server in self.servers(backend).items()}

    def add_servers(self, backend: str, servers: dict[str, str]) -> None:
        """New servers of `backend` (by name: `host:port` and its options, `weight` among them),
        taken into service and health-checked at once (HAProxy adds them in maintenance)."""
        _check(backend, "backend")
        commands = []
        for server, line in sorted(servers.items()):
            _check(server, "server")
            if not SERVER_LINE.fullmatch(line):
                raise HAProxyError(f"HAProxy runtime API: refused to add {server} as {line!r}")
            where = f"{backend}/{server}"
            commands += [f"add server {where} {line}", f"enable server {where}"]
            commands += [f"enable health {where}"] if " check" in line else []
        answer = self.command(*commands)
        refused = [a for a in answer.splitlines() if a.strip() and a != "New server registered."]
        if refused:
            raise HAProxyError(f"HAProxy at {self.address}, backend {backend}: {refused[0]}")

    def delete_servers(self, backend: str, servers: list[str]) -> None:
        """Servers taken out of `backend` for good (into maintenance first, as HAProxy wants);
        one still holding connections is refused, and asked again at the next sync."""
        _check(backend, "backend")
        commands = []
        for server in servers:
            _check(server, "server")
            commands += [f"set server {backend}/{server} state maint"]
            commands += [f"del server {backend}/{server}"]
        answer = self.command(*commands)
        refused = [a for a in answer.splitlines() if a.strip() and a != "Server deleted."]
        if refused:
            raise HAProxyError(f"HAProxy at {self.address}, backend {backend}: {refused[0]}")

    def move_server(self, backend: str, server: str, address: str, check_port: int) -> None:
        """A server's new `host:port` (and health-check port, where checks go elsewhere)."""
        _check(backend, "backend")
        _check(server, "server")
        host, _, port = address.rpartition(":")
        if not SERVER_LINE.fullmatch(address) or not port.isdigit():
            raise HAProxyError(f"HAProxy runtime API: refused to move {server} to {address!r}")
        commands = [f"set server {backend}/{server} addr {host} port {port}"]
        if check_port:
            commands.append(f"set server {backend}/{server} check-port {check_port}")
        answer = self.command(*commands).strip()
        if answer and not answer.startswith(("IP changed", "no need to change", "port changed")):
            raise HAProxyError(f"HAProxy at {self.address}, backend {backend}: {answer}")

    def set_weights(self, backend: str, weights: dict[str, int]) -> None:
        """All in one call; HAProxy answers only when a command fails (in its own words)."""
        if not weights:
            return
        _check(backend, "backend")
        for server in weights:
            _check(server, "server")
        commands = [f"set weight {backend}/{server} {w}" for server, w in sorted(weights.items())]
        answer = self.command(*commands).strip()
        if answer:
            raise HAProxyError(f"HAProxy at {self.address}, backend {backend}: {answer}")

    def in_flight(self, backends: list[str], server: str) -> int:
        """Requests `server` is answering now, over `backends` (`scur` of `show stat`)."""
        answer = self.command("show stat -1 4 -1").lstrip("# ")
        rows = csv.DictReader(io.StringIO(answer))
        return sum(
            int(row["scur"] or 0)
            for row in rows
            if row.get("pxname") in backends and row.get("svname") == server
        )


def _check(name: str, what: str) -> None:
    """Refuse a name before any command is sent."""
    if refused := name_refusal(name, what=what):
        raise HAProxyError(f"HAProxy runtime API: {refused}")

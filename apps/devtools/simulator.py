"""A Triton simulator for load tests only, like Kubernetes' kwok: one process serving many fake
nodes, each on its own TCP port with its own state, so a benchmark can drive 500 nodes from one
machine. It never stands in for Triton in correctness tests.

It speaks the subset of Triton's HTTP/REST (KServe v2) protocol that `apps.fleet.triton` uses:
health, server metadata, repository index, load (with a config override), unload, model config,
a version's readiness, and /metrics on the same port. What it copies from Triton: a load serves
exactly the versions its override's `specific` version policy names (otherwise version 1),
versions no longer named become UNAVAILABLE "unloaded", a failed load leaves already READY
versions serving, errors are HTTP 400 with `{"error": "..."}`, and a hung load (`hang`) stays
LOADING, unanswered, until a restart. What it does not model: a repository on disk
(`latest`/`all` policies mean version 1), ensembles and their dependents, inference.

asyncio rather than threads: 500 listening ports and hundreds of connections in one thread.
Run it with `python -m apps.devtools.simulator --nodes 500 --base-port 8100 --load-ms 50`.
"""

import argparse
import asyncio
import json
import random
import re
import resource
import signal
import socket
import threading
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from http import HTTPStatus
from types import TracebackType
from typing import Any
from urllib.parse import unquote

from apps.fleet.triton import TritonClient

TRITON_VERSION = "2.51.0"
EXTENSIONS = [
    "classification",
    "sequence",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "cuda_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
]
FAILURE_REASON = "simulated load failure (failure_rate)"
MAX_BODY_BYTES = 16 * 2**20
FLOOR_TIMEOUT_S = 30.0

# A steady synthetic traffic on every READY version, so rate() and quantile queries see data:
# requests per second, and what each request adds to each of Triton's counters.
TRAFFIC_RPS = 10.0
_COUNTERS = {
    "nv_inference_request_success": 1,
    "nv_inference_count": 2,
    "nv_inference_exec_count": 1,
    "nv_inference_request_duration_us": 1500,
    "nv_inference_queue_duration_us": 100,
    "nv_inference_compute_infer_duration_us": 1300,
}
_QUANTILES_US = {"0.5": 1400, "0.9": 1800, "0.95": 2000, "0.99": 2500, "0.999": 3000}
MODEL_MEMORY_BYTES = 100 * 2**20

# Triton accepts any directory name; the simulator has none, so it accepts the names the product
# writes and refuses the rest like a name the repository lacks.
_MODEL_NAME = re.compile(r"[\w.-]+")
_REPOSITORY_CALL = re.compile(r"/v2/repository/models/([^/]+)/(load|unload)")
_CONFIG_CALL = re.compile(r"/v2/models/([^/]+)/config")
_READY_CALL = re.compile(r"/v2/models/([^/]+)/versions/(\d{1,9})/ready")

Reply = tuple[int, str, bytes]
JSON = "application/json"


class Refused(Exception):
    """What Triton answers with HTTP 400 and `{"error": message}`."""


@dataclass
class Version:
    state: str
    reason: str
    ready_since: float = 0.0  # monotonic seconds: the synthetic traffic counts from here


@dataclass
class SimNode:
    """One simulated Triton: its own repository state and its own seeded RNG, so what each node
    does is independent of how requests to the others interleave."""

    rng: random.Random
    load_s: float
    failure_rate: float
    holds: frozenset[str] | None  # model names its repository holds; None: any
    hangs: frozenset[str] = frozenset()  # models whose loads never end (LOADING until a restart)
    versions: dict[str, dict[int, Version]] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def handle(self, method: str, path: str, body: bytes) -> Reply:
        try:
            return await self._route(method, path, body)
        except Refused as exc:
            return _json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})

    async def _route(self, method: str, path: str, body: bytes) -> Reply:
        if method == "GET" and path in ("/v2/health/live", "/v2/health/ready"):
            return HTTPStatus.OK, JSON, b""
        if method == "GET" and path == "/v2":
            return _json(
                HTTPStatus.OK,
                {"name": "triton", "version": TRITON_VERSION, "extensions": EXTENSIONS},
            )
        if method == "GET" and path == "/metrics":
            return HTTPStatus.OK, "text/plain; version=0.0.4", self.metrics().encode()
        if method == "POST" and path == "/v2/repository/index":
            return _json(HTTPStatus.OK, self.index())
        if method == "POST" and (match := _REPOSITORY_CALL.fullmatch(path)):
            name = unquote(match[1])
            if match[2] == "load":
                await self.load(name, _load_override(name, body))
            else:
                self.unload(name)
            return HTTPStatus.OK, JSON, b""
        if method == "GET" and (match := _CONFIG_CALL.fullmatch(path)):
            return _json(HTTPStatus.OK, self.config(unquote(match[1])))
        if method == "GET" and (match := _READY_CALL.fullmatch(path)):
            version = self.versions.get(unquote(match[1]), {}).get(int(match[2]))
            ready = version is not None and version.state == "READY"
            return (HTTPStatus.OK, JSON, b"") if ready else _json(HTTPStatus.BAD_REQUEST, {})
        return _json(HTTPStatus.NOT_FOUND, {"error": "Not Found"})

    def _require_held(self, name: str, action: str) -> None:
        if not _MODEL_NAME.fullmatch(name) or (self.holds is not None and name not in self.holds):
            raise Refused(f"failed to {action} '{name}', failed to poll from model repository")

    async def load(self, name: str, override: dict[str, Any]) -> None:
        self._require_held(name, "load")
        wanted = _wanted_versions(name, override)
        if name in self.hangs:  # as Triton's stuck loads (server#8766): no answer, ever
            versions = self.versions.setdefault(name, {})
            versions.update({number: Version("LOADING", "") for number in wanted})
            await asyncio.Event().wait()
        await asyncio.sleep(self.load_s)
        versions = self.versions.setdefault(name, {})
        if self.rng.random() < self.failure_rate:
            # Like Triton: a failed reload leaves the versions already serving as they were.
            for number in wanted:
                if number not in versions or versions[number].state != "READY":
                    versions[number] = Version("UNAVAILABLE", FAILURE_REASON)
            failed = "\n".join(
                f"version {n} is at UNAVAILABLE state: {FAILURE_REASON};" for n in wanted
            )
            raise Refused(f"load failed for model '{name}': {failed}")
        for number, version in versions.items():
            if number not in wanted and version.state == "READY":
                versions[number] = Version("UNAVAILABLE", "unloaded")
        now = time.monotonic()
        for number in wanted:
            versions[number] = Version("READY", "", now)
        self.configs[name] = {**override, "name": name}

    def unload(self, name: str) -> None:
        """Every READY version becomes UNAVAILABLE; ensembles are not modelled, so there are no
        dependents to unload with it."""
        self._require_held(name, "unload")
        for number, version in self.versions.get(name, {}).items():
            if version.state == "READY":
                self.versions[name][number] = Version("UNAVAILABLE", "unloaded")

    def config(self, name: str) -> dict[str, Any]:
        versions = self.versions.get(name)
        if versions is None:
            raise Refused(f"Request for unknown model: '{name}' is not found")
        if all(v.state != "READY" for v in versions.values()):
            raise Refused(f"Request for unknown model: '{name}' has no available versions")
        return self.configs[name]

    def index(self) -> list[dict[str, str]]:
        """Triton's rows, sorted by name and version; a held model never loaded: its name only."""
        rows = [{"name": name} for name in (self.holds or frozenset()) - self.versions.keys()]
        for name, versions in self.versions.items():
            rows += [
                {"name": name, "version": str(n), "state": v.state, "reason": v.reason}
                for n, v in versions.items()
            ]
        return sorted(rows, key=lambda row: (row["name"], int(row.get("version", 0))))

    def metrics(self) -> str:
        now = time.monotonic()
        ready = [
            (f'model="{name}",version="{n}"', (now - v.ready_since) * TRAFFIC_RPS)
            for name, versions in sorted(self.versions.items())
            for n, v in sorted(versions.items())
            if v.state == "READY"
        ]
        lines = []
        for metric, per_request in _COUNTERS.items():
            lines.append(f"# TYPE {metric} counter")
            lines += [f"{metric}{{{labels}}} {int(count) * per_request}" for labels, count in ready]
        lines.append("# TYPE nv_inference_request_summary_us summary")
        for labels, count in ready:
            lines += [
                f'nv_inference_request_summary_us{{{labels},quantile="{q}"}} {us}'
                for q, us in _QUANTILES_US.items()
            ]
            lines.append(f"nv_inference_request_summary_us_count{{{labels}}} {int(count)}")
            per_request = _COUNTERS["nv_inference_request_duration_us"]
            lines.append(
                f"nv_inference_request_summary_us_sum{{{labels}}} {int(count) * per_request}"
            )
        lines += [
            "# TYPE nv_cpu_utilization gauge",
            "nv_cpu_utilization 0.25",
            "# TYPE nv_cpu_memory_used_bytes gauge",
            f"nv_cpu_memory_used_bytes {2**30 + len(ready) * MODEL_MEMORY_BYTES}",
            "# TYPE nv_cpu_memory_total_bytes gauge",
            f"nv_cpu_memory_total_bytes {64 * 2**30}",
        ]
        return "\n".join(lines) + "\n"


def _json(status: int, data: Any) -> Reply:
    return status, JSON, json.dumps(data).encode()


def _load_override(name: str, body: bytes) -> dict[str, Any]:
    """The config override of a load request (`{"parameters": {"config": "<json>"}}`), or {}."""
    try:
        request = json.loads(body or b"{}")
        config = request.get("parameters", {}).get("config")
        override = json.loads(config) if config is not None else {}
    except (ValueError, AttributeError, TypeError) as exc:
        raise Refused(f"failed to load '{name}', failed to parse the request: {exc}") from None
    if not isinstance(override, dict):
        raise Refused(f"failed to load '{name}', the config override is not a JSON object")
    return override


def _wanted_versions(name: str, override: dict[str, Any]) -> list[int]:
    """The versions a load serves. json_format writes int64 version numbers as strings."""
    policy = override.get("version_policy") or {}
    try:
        numbers = sorted({int(n) for n in policy.get("specific", {}).get("versions", [])})
    except (ValueError, TypeError, AttributeError):
        raise Refused(f"failed to load '{name}', invalid version_policy {policy!r}") from None
    return numbers or [1]


# -- HTTP/1.1: just what tritonclient.http (geventhttpclient, keep-alive) sends -----------------


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    length: int
    keep_alive: bool


def _parse_head(head: bytes) -> Request | None:
    """The request line and headers, or None when malformed or beyond what a Triton client sends
    (chunked bodies, oversized bodies)."""
    try:
        request_line, *header_lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
        method, target, protocol = request_line.split(" ")
        headers = {}
        for line in header_lines:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip().lower()
        length = int(headers.get("content-length", "0"))
    except ValueError:
        return None
    if "transfer-encoding" in headers or not 0 <= length <= MAX_BODY_BYTES:
        return None
    connection = headers.get("connection", "")
    keep_alive = connection != "close" if protocol == "HTTP/1.1" else connection == "keep-alive"
    return Request(method, target.split("?", 1)[0], length, keep_alive)


def _response(status: int, content_type: str, body: bytes, *, keep_alive: bool) -> bytes:
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    return head.encode("latin-1") + body


async def _serve_connection(
    node: SimNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return  # the client closed the connection, or sent a head no client would
            request = _parse_head(head)
            if request is None:
                writer.write(_response(HTTPStatus.BAD_REQUEST, JSON, b"", keep_alive=False))
                await writer.drain()
                return
            body = await reader.readexactly(request.length)
            status, content_type, payload = await node.handle(request.method, request.path, body)
            writer.write(_response(status, content_type, payload, keep_alive=request.keep_alive))
            await writer.drain()
            if not request.keep_alive:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    except asyncio.CancelledError:  # the simulator stopping under a hung load: nothing to say
        return
    finally:
        writer.close()


# -- the simulator -----------------------------------------------------------------------------


class Simulator:
    """Serves one simulated node per entry of `ports` (0: a free port) from a background thread.

    `ports` holds the bound ports once `start()` returns; `urls` their http:// addresses.
    """

    def __init__(
        self,
        ports: Sequence[int],
        *,
        load_ms: float = 0.0,
        failure_rate: float = 0.0,
        seed: int = 0,
        models: Collection[str] | None = None,
        hang: Collection[str] = (),
        host: str = "127.0.0.1",
    ) -> None:
        if not 0.0 <= failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be between 0 and 1, not {failure_rate}")
        if load_ms < 0:
            raise ValueError(f"load_ms must not be negative, not {load_ms}")
        holds, hangs = (frozenset(models) if models is not None else None), frozenset(hang)
        self.nodes = [
            SimNode(random.Random(f"{seed}:{i}"), load_ms / 1000, failure_rate, holds, hangs)
            for i in range(len(ports))
        ]
        self.host = host
        self.ports = list(ports)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._error: Exception | None = None

    @property
    def urls(self) -> list[str]:
        return [f"http://{self.host}:{port}" for port in self.ports]

    def start(self) -> None:
        """Listen on every port; raises what binding raised (a taken port, say)."""
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="triton-simulator", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error

    def stop(self) -> None:
        """Close every port and connection; returns once the thread is gone."""
        if self._thread is None or self._loop is None or self._stopping is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._thread = None

    def __enter__(self) -> "Simulator":
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._serve(ready))
        except Exception as exc:
            self._error = exc
        finally:
            ready.set()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        servers = []
        try:
            for node, port in zip(self.nodes, self.ports, strict=True):
                handler = partial(_serve_connection, node)
                servers.append(await asyncio.start_server(handler, self.host, port))
            self.ports = [server.sockets[0].getsockname()[1] for server in servers]
            ready.set()
            await self._stopping.wait()
        finally:
            # asyncio.run then cancels the open connections' tasks, which close their sockets.
            for server in servers:
                server.close()


def floor_load(urls: list[str], loads: list[tuple[str, str]], concurrency: int) -> float:
    """Seconds to run `loads` ((model, config JSON) in order) on every node of `urls`, each load
    followed by a read of that node's index, as the product does, `concurrency` nodes at a time,
    with nothing of the product in between: the floor a benchmark compares the product to.
    Raises the first failed call."""

    def release(url: str) -> None:
        client = TritonClient(url, timeout=FLOOR_TIMEOUT_S)
        for model, config_json in loads:
            client.load(model, config_json=config_json)
            client.repository_index()

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(release, urls))
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m apps.devtools.simulator",
        description="Simulated Triton nodes for load tests; one line per node, stops on SIGTERM.",
    )
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--base-port", type=int, default=0, help="consecutive from here; 0: free")
    parser.add_argument("--ports", default="", help="comma-separated, one per node (not --nodes)")
    parser.add_argument("--load-ms", type=float, default=50.0)
    parser.add_argument("--failure-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", default="", help="comma-separated names held; default: any")
    parser.add_argument("--hang", default="", help="comma-separated models whose loads hang")
    args = parser.parse_args(argv)
    if args.ports:
        ports = [int(port) for port in args.ports.split(",")]
    elif args.nodes >= 1:
        ports = [args.base_port + i if args.base_port else 0 for i in range(args.nodes)]
    else:
        parser.error("--nodes must be at least 1")
    try:
        simulator = Simulator(
            ports,
            load_ms=args.load_ms,
            failure_rate=args.failure_rate,
            seed=args.seed,
            models=args.models.split(",") if args.models else None,
            hang=args.hang.split(",") if args.hang else (),
        )
    except ValueError as exc:
        parser.error(str(exc))
    # Every node holds a listening socket and its clients' connections: a thousand nodes pass the
    # usual soft limit of 1024 descriptors, so take the hard limit.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    # The kernel hands a stop signal to any thread, numpy's OpenBLAS threads (started on import,
    # before any mask could be set) included: Python's own handler, whichever thread runs it,
    # writes the signal's number to the wakeup socket this thread reads.
    wakeup, wakeup_writer = socket.socketpair()
    wakeup_writer.setblocking(False)
    signal.set_wakeup_fd(wakeup_writer.fileno())
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    simulator.start()
    for number, url in enumerate(simulator.urls, start=1):
        print(f"node {number}: {url} (metrics {url}/metrics)")
    print(f"ready: {len(simulator.urls)} simulated Triton nodes", flush=True)
    received = wakeup.recv(1)[0]
    simulator.stop()
    print(f"stopped on {signal.Signals(received).name}", flush=True)


if __name__ == "__main__":
    main()

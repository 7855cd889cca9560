import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from apps.devtools.autoscaler import Follower
from apps.devtools.devfleet import Devfleet
from apps.devtools.processes import POOL_BACKENDS, DevfleetError, Proc
from apps.devtools.traffic import send_traffic
from apps.fleet.errors import FleetError
from apps.fleet.models import Node, NodePool
from apps.fleet.selectors import node_list
from apps.fleet.services.nodes import node_register
from apps.fleet.services.pools import pool_set_discoverable, pool_set_traffic
from apps.fleet.triton import TritonClient, TritonError
from apps.scaling.hpa import Autoscaler

SIMULATED_MAX = 5000  # one asyncio process starts 5,000 nodes in under a second


class Command(BaseCommand):
    help = (
        "Run a local fleet of real tritonserver nodes and a Prometheus that scrapes them, "
        "or simulated nodes for load tests."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--home", type=Path, default=settings.VAR_DIR / "devfleet")
        parser.add_argument(
            "--repository", type=Path, default=settings.BASE_DIR / "deploy" / "models"
        )
        sub = parser.add_subparsers(dest="action", required=True)
        up = sub.add_parser("up", help="start the nodes and Prometheus, register the nodes")
        up.add_argument("--nodes", type=int, default=3)
        up.add_argument("--pool", default="demo")
        up.add_argument("--base-port", type=int, default=8100, help="0 picks free ports")
        up.add_argument("--prometheus-port", type=int, default=9090)
        up.add_argument(
            "--simulated",
            type=int,
            default=0,
            metavar="N",
            help="N simulated nodes in one process instead of real ones (load tests only)",
        )
        up.add_argument(
            "--haproxy",
            action="store_true",
            help="HAProxy in front of the pool: exact canary shares, drained loads",
        )
        up.add_argument(
            "--discover",
            action="store_true",
            help="leave the nodes to the control plane's discovery (DISCOVERY_SCRAPE_POOL=triton) "
            "instead of registering them",
        )
        up.add_argument("--load-ms", type=float, default=50.0, help="simulated load latency")
        up.add_argument("--failure-rate", type=float, default=0.0, help="simulated load failures")
        up.add_argument(
            "--load",
            action="append",
            default=[],
            metavar="MODEL:VERSION",
            help="load this release on every node (ensembles bring their pinned steps)",
        )
        alerts = sub.add_parser(
            "alerts", help="an Alertmanager sending the fleet's alerts to the control plane"
        )
        alerts.add_argument("--to", required=True, help="the control plane's /api/alertmanager")
        alerts.add_argument("--token", required=True, help="an API token of an operator")
        alerts.add_argument(
            "--rules",
            type=Path,
            default=settings.BASE_DIR / "deploy" / "prometheus" / "alerts.yml",
            help="the alerting rules Prometheus evaluates",
        )
        down = sub.add_parser("down", help="stop exactly the processes `up` started")
        down.add_argument(
            "--grace",
            type=float,
            default=5.0,
            help="seconds every process has to exit on SIGTERM before SIGKILL",
        )
        sub.add_parser("status", help="list the fleet's processes and registered nodes")
        for action, text in (
            ("kill", "SIGKILL one node, or prometheus (a crash drill)"),
            ("restart", "start a killed node (or prometheus) again"),
        ):
            sub.add_parser(action, help=text).add_argument("node")
        add = sub.add_parser(
            "add-node", help="start one more node and list it for Prometheus (file_sd)"
        )
        add.add_argument("--pool", default="demo")
        sub.add_parser(
            "remove-node", help="stop listing a node for Prometheus, and stop it"
        ).add_argument("node")
        scale = sub.add_parser(
            "autoscale",
            help="follow the pool's wanted nodes as an HPA would (apps/devtools/autoscaler.py)",
        )
        scale.add_argument("--pool", default="demo")
        scale.add_argument("--least", type=int, default=1, help="as an HPA's minReplicas")
        scale.add_argument("--most", type=int, default=6, help="as an HPA's maxReplicas")
        scale.add_argument("--period", type=float, default=15.0, help="seconds between syncs")
        scale.add_argument(
            "--window", type=float, default=300.0, help="scale-down stabilization, seconds"
        )
        fault = sub.add_parser(
            "fault",
            help="slow a demo model down or make it fail, at runtime on every node (0 0: heal)",
        )
        fault.add_argument("model")
        fault.add_argument("--delay-ms", type=float, default=0.0)
        fault.add_argument("--error-rate", type=float, default=0.0)
        traffic = sub.add_parser(
            "traffic",
            help="send real inference requests: through HAProxy if it runs, else round-robin",
        )
        traffic.add_argument("--model", required=True)
        traffic.add_argument("--rps", type=float, default=5.0)
        traffic.add_argument("--seconds", type=float, default=60.0)
        traffic.add_argument("--pool", default="")
        traffic.add_argument(
            "--wait", type=float, default=0.0, help="seconds to wait for the model"
        )

    def handle(self, *args: object, **options: object) -> None:
        fleet = Devfleet(home=options["home"], repository=options["repository"])  # type: ignore[arg-type]
        try:
            getattr(self, f"_{str(options['action']).replace('-', '_')}")(fleet, **options)
        except (DevfleetError, TritonError, FleetError) as exc:
            raise CommandError(str(exc)) from None

    def _up(
        self, fleet: Devfleet, *, nodes: int, pool: str, base_port: int, **options: object
    ) -> None:
        if options["simulated"]:
            self._up_simulated(fleet, pool=pool, base_port=base_port, **options)  # type: ignore[arg-type]
            return
        if not 1 <= nodes <= 16:
            raise CommandError("--nodes must be between 1 and 16")
        state = fleet.up(
            nodes=nodes,
            pool=pool,
            base_port=base_port or None,
            prometheus_port=options["prometheus_port"] or None,  # type: ignore[arg-type]
        )
        NodePool.objects.get_or_create(name=pool)
        if options["discover"]:
            pool_set_discoverable(pool_name=pool, discoverable=True, actor="system:devfleet")
        for proc in state.nodes:
            if not options["discover"]:
                node_register(
                    name=proc.name, pool=pool, actor="system:devfleet", **state.node_urls(proc)
                )
            self.stdout.write(f"{proc.name}: {state.node_urls(proc)['http_url']} (log {proc.log})")
        self.stdout.write(f"prometheus: {state.prometheus_url}, nodes listed in {fleet.targets}")
        if options["haproxy"]:
            # After the nodes' ports: 8109-8111 for the demo's three nodes from 8100.
            balancer = fleet.balancer(base_port=base_port and base_port + 3 * nodes)
            pool_set_traffic(
                pool_name=pool,
                traffic=NodePool.Traffic.HAPROXY,
                runtime=f"127.0.0.1:{balancer.ports['runtime']}",
                backends=list(POOL_BACKENDS),
                min_serving=nodes - 1,  # one node out of traffic at a time
                actor="system:devfleet",
            )
            ports = balancer.ports
            self.stdout.write(
                f"haproxy: http://127.0.0.1:{ports['http']}, grpc 127.0.0.1:{ports['grpc']}, "
                f"runtime API 127.0.0.1:{ports['runtime']} (log {balancer.log})"
            )
        for release in options["load"]:  # type: ignore[attr-defined]
            model, _, version = release.partition(":")
            if not version.isdecimal():
                raise CommandError(
                    f"--load {release!r}: expected MODEL:VERSION, e.g. rag_pipeline:1"
                )
            for proc in state.nodes:
                urls = state.node_urls(proc)
                client = TritonClient(urls["http_url"], node=proc.name, grpc=urls["grpc_url"])
                fleet.load_release(client, model, int(version))
            self.stdout.write(f"loaded {model} v{version} on {len(state.nodes)} nodes")

    def _alerts(self, fleet: Devfleet, *, to: str, token: str, rules: Path, **_: object) -> None:
        proc = fleet.alerting(receiver=to, token=token, rules=rules)
        self.stdout.write(
            f"alertmanager: http://127.0.0.1:{proc.ports['web']} -> {to} (log {proc.log})"
        )

    def _up_simulated(
        self,
        fleet: Devfleet,
        *,
        simulated: int,
        pool: str,
        base_port: int,
        load_ms: float,
        failure_rate: float,
        load: list[str],
        **options: object,
    ) -> None:
        if not 1 <= simulated <= SIMULATED_MAX:
            raise CommandError(f"--simulated must be between 1 and {SIMULATED_MAX}")
        if not (0 <= failure_rate <= 1 and load_ms >= 0):
            raise CommandError("--failure-rate must be in [0, 1] and --load-ms at least 0")
        if load:
            raise CommandError("--load needs real nodes; simulated nodes hold no repository")
        state = fleet.up_simulated(
            nodes=simulated,
            pool=pool,
            base_port=base_port or None,
            load_ms=load_ms,
            failure_rate=failure_rate,
        )
        for name, urls in state.simulated_urls().items():
            node_register(name=name, pool=pool, actor="system:devfleet", **urls)
        proc = state.simulator
        assert proc is not None
        names = list(proc.ports)
        self.stdout.write(
            f"{len(names)} simulated nodes {names[0]}..{names[-1]} in pool {pool} on ports "
            f"{_port_span(proc)} (pid {proc.pid}, log {proc.log})"
        )

    def _down(self, fleet: Devfleet, *, grace: float, **options: object) -> None:
        for line in fleet.down(grace_s=grace) or ["nothing to stop"]:
            self.stdout.write(line)

    def _kill(self, fleet: Devfleet, *, node: str, **options: object) -> None:
        proc = fleet.kill(node)
        self.stdout.write(f"{node}: killed (pid {proc.pid})")

    def _add_node(self, fleet: Devfleet, *, pool: str, **options: object) -> None:
        proc = fleet.add_node(pool)
        self.stdout.write(
            f"{proc.name}: {fleet.state().node_urls(proc)['http_url']}, listed in {fleet.targets}"
        )

    def _remove_node(self, fleet: Devfleet, *, node: str, **options: object) -> None:
        fleet.remove_node(node)
        self.stdout.write(f"{node}: no longer listed, stopped")

    def _autoscale(
        self,
        fleet: Devfleet,
        *,
        pool: str,
        least: int,
        most: int,
        period: float,
        window: float,
        **options: object,
    ) -> None:
        if not 0 <= least <= most:
            raise CommandError("--least must be 0 or more and at most --most")
        scaler = Autoscaler(least=least, most=most, scale_down_window_s=window, tolerance=0)
        follower = Follower(fleet, pool, scaler)
        while True:  # until Ctrl-C, as a controller runs
            self.stdout.write(follower.step(time.monotonic()))
            self.stdout.flush()
            time.sleep(period)

    def _restart(self, fleet: Devfleet, *, node: str, **options: object) -> None:
        proc = fleet.restart(node)
        self.stdout.write(f"{node}: running again (pid {proc.pid})")

    def _fault(
        self, fleet: Devfleet, *, model: str, delay_ms: float, error_rate: float, **_: object
    ) -> None:
        fleet.fault(model, delay_ms=delay_ms, error_rate=error_rate)
        healed = not (delay_ms or error_rate)
        what = "no fault" if healed else f"+{delay_ms:g} ms, {error_rate:.0%} failing"
        self.stdout.write(f"{model}: {what}, from its next request on every node")

    def _status(self, fleet: Devfleet, **options: object) -> None:
        state = fleet.state()
        for proc in state.processes:
            status = "running" if proc.running else "stopped"
            ports = " ".join(f"{k}={v}" for k, v in proc.ports.items())
            if proc is state.simulator:
                ports = f"{len(proc.ports)} nodes on ports {_port_span(proc)}"
            self.stdout.write(f"{proc.name:<12} pid {proc.pid:<8} {status:<8} {ports}")
        for node in node_list():
            ready = node.ready_versions.items()
            models = ", ".join(f"{m} v{v}" for m, versions in ready for v in versions) or "-"
            self.stdout.write(f"node {node.name:<12} {node.health:<12} {node.http_url}  {models}")

    def _traffic(
        self,
        fleet: Devfleet,
        *,
        model: str,
        rps: float,
        seconds: float,
        pool: str,
        wait: float,
        **options: object,
    ) -> None:
        if not (0 < rps <= 500 and 0 < seconds <= 24 * 3600):
            raise CommandError("--rps must be in (0, 500] and --seconds in (0, 86400]")
        balancer = fleet.state().haproxy
        if balancer is not None and balancer.running:  # as clients would: through HAProxy
            url = f"http://127.0.0.1:{balancer.ports['http']}"
            clients = [
                TritonClient(url, node="haproxy", grpc=f"127.0.0.1:{balancer.ports['grpc']}")
            ]
        else:  # the nodes serving now (found by discovery a little after `up`: waited for)
            nodes = Node.objects.filter(health=Node.Health.READY, stage=Node.Stage.SERVING)
            nodes = nodes.filter(pool__name=pool) if pool else nodes
            deadline = time.monotonic() + wait
            while not nodes.exists() and time.monotonic() < deadline:
                time.sleep(1)
            clients = [TritonClient.of(n) for n in nodes]
        if not clients:
            raise CommandError("no node serves; start them with `devfleet up`")
        results = send_traffic(
            clients,
            model=model,
            rps=rps,
            seconds=seconds,
            wait=wait,
        )
        for key, count in sorted(results.items()):
            self.stdout.write(f"{key}: {count}")


def _port_span(proc: Proc) -> str:
    """The simulator's ports, one per node: consecutive unless --base-port 0 picked free ones."""
    return f"{min(proc.ports.values())}..{max(proc.ports.values())}"

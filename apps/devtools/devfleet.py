"""A local fleet of real tritonserver processes (from the nvidia-pytriton wheel) and a Prometheus
that scrapes them, for the demo and the integration tests; or, for load tests, one process of
simulated nodes (`apps.devtools.simulator`).

Every process is started in its own session and recorded in a state file with its pid and its
start time; `down` stops only a process whose /proc entry still shows that pid *and* start time, so
it never kills a process it did not start, even one that reused a recorded pid.
"""

import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytriton

from apps.devtools import targets
from apps.devtools.processes import (
    DevfleetError,
    FleetState,
    PortTaken,
    Proc,
    haproxy_config,
    ports_free,
    proc_stat,
    require_binary,
    simulator_env,
    stop,
    triton_env,
    wait_gone,
    wait_http,
    wait_simulator,
    write_whole,
)
from apps.fleet.triton import TritonClient, TritonError
from apps.registry.codec import pin_versions, to_json
from apps.registry.ensembles import Resolved, pinned_steps
from apps.registry.repository import read_model

# The stub must match the Python it embeds; pytriton ships one per version.
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
# Starts of one node on newly picked ports before a port taken each time is the user's to see.
PORT_PICKS = 3


class Devfleet:
    def __init__(self, *, home: Path, repository: Path) -> None:
        self.home = home
        self.repository = repository.resolve()
        self.state_file = home / "state.json"

    # -- state -----------------------------------------------------------------------------------

    def state(self) -> FleetState:
        return FleetState.read(self.state_file)

    def _save(self, state: FleetState) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        state.write(self.state_file)

    # -- up / down -------------------------------------------------------------------------------

    def up(
        self,
        *,
        nodes: int,
        pool: str,
        base_port: int | None,
        prometheus_port: int | None,
        repository_key: str = "",
    ) -> FleetState:
        """`repository_key` ("name=value"): nodes serve the repository API only to requests
        with that header, as Triton's --http-restricted-api has it."""
        self._require_stopped()
        self._triton_install()  # a missing Triton or stub refused before anything starts
        self._precompile()
        prometheus = require_binary("prometheus", "apt-get install -y prometheus")
        ports = ports_free(nodes * 3, base_port)
        state = FleetState()
        try:
            for i in range(nodes):
                proc = self._start_node(f"{pool}-{i + 1}", ports[3 * i : 3 * i + 3], repository_key)
                state.nodes.append(proc)
                self._save(state)
            for i in range(nodes):
                self._serving(state, i, repository_key, repick=base_port is None)
            targets.write(self.targets, state.nodes, pool)
            for attempt in range(PORT_PICKS):  # as `_serving` does for the nodes
                web = ports_free(1, prometheus_port)[0]
                state.prometheus = self._start_prometheus(prometheus, web)
                self._save(state)
                try:
                    wait_http(f"{state.prometheus_url}/-/ready", state.prometheus)
                    break
                except PortTaken:
                    if prometheus_port is not None or attempt == PORT_PICKS - 1:
                        raise
        except BaseException:
            self.down()
            raise
        return state

    def _start_node(self, name: str, ports: list[int], repository_key: str = "") -> Proc:
        tritonserver, backends = self._triton_install()
        http, grpc, metrics = ports
        argv = [
            tritonserver,
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            "--model-control-mode=explicit",
            "--strict-readiness=false",
            "--metrics-config=summary_latencies=true",
            "--metrics-interval-ms=1000",
            # Verbose: the node's log shows every repository request it received.
            "--log-verbose=1",
            f"--http-port={http}",
            f"--grpc-port={grpc}",
            f"--metrics-port={metrics}",
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            "--metrics-address=127.0.0.1",
            f"--id={name}",
        ]
        if repository_key:
            argv.append(f"--http-restricted-api=model-repository:{repository_key}")
        ports_of = {"http": http, "grpc": grpc, "metrics": metrics}
        return self._spawn(name, argv, ports_of, triton_env())

    def _serving(self, state: FleetState, i: int, repository_key: str, *, repick: bool) -> None:
        """Wait until node `i` serves. Ports are picked free, then bound by tritonserver
        seconds later: if another process took one meanwhile, the node exits, and with
        `repick` (ports of the OS's choice) starts again on new ones."""
        for attempt in range(PORT_PICKS):
            try:
                node = state.nodes[i]
                wait_http(f"http://127.0.0.1:{node.ports['http']}/v2/health/live", node)
                return
            except PortTaken:
                if not repick or attempt == PORT_PICKS - 1:
                    raise
            name = state.nodes[i].name
            state.nodes[i] = self._start_node(name, ports_free(3, None), repository_key)
            self._save(state)

    # -- nodes that come and go, found by Prometheus (file_sd) -----------------------------------

    @property
    def targets(self) -> Path:
        """Prometheus' file_sd list of the fleet's nodes: one line each, `node` and `pool` labels
        and the ports of the node's HTTP and gRPC endpoints (the control plane's discovery reads
        them from Prometheus' targets API)."""
        return self.home / "targets" / "nodes.yml"

    def add_node(self, pool: str) -> Proc:
        """One more node, started, then listed for Prometheus: the control plane finds it."""
        state = self.state()
        name = f"{pool}-{len(state.nodes) + 1}"
        self._precompile()
        state.nodes.append(self._start_node(name, ports_free(3, None)))
        self._save(state)
        self._serving(state, len(state.nodes) - 1, "", repick=True)
        proc = state.nodes[-1]
        targets.add(self.targets, proc, pool)
        return proc

    def remove_node(self, name: str) -> Proc:
        """A node no longer listed for Prometheus, then stopped (a pod scaled away)."""
        self.unlist(name)
        return self.stop(name)

    def unlist(self, name: str) -> None:
        """The node's target gone from Prometheus' list: discovery takes it out of traffic."""
        targets.drop(self.targets, name)

    def stop(self, name: str) -> Proc:
        """SIGTERM, as a pod's container gets, and its end waited for."""
        proc = self._proc(name)
        if proc.running:
            os.killpg(proc.pid, signal.SIGTERM)
            wait_gone(proc, 15.0)
        return proc

    def alerting(self, *, receiver: str, token: str, rules: Path) -> Proc:
        """An Alertmanager posting every alert group to `receiver` (the control plane's
        /api/alertmanager) with `token`, and the fleet's Prometheus evaluating `rules` and
        sending to it: its configuration rewritten and reloaded (SIGHUP)."""
        state = self.state()
        if state.prometheus is None or not state.prometheus.running:
            raise DevfleetError("start the fleet first: its Prometheus evaluates the rules")
        binary = require_binary(
            "prometheus-alertmanager", "apt-get install -y prometheus-alertmanager"
        )
        self.alerting_stop()
        port = ports_free(1, None)[0]
        route = {"receiver": "controlplane", "group_by": ["alertname", "pool", "model"]}
        route |= {"group_wait": "1s", "group_interval": "5s", "repeat_interval": "1h"}
        webhook = {"url": receiver, "send_resolved": True}
        webhook["http_config"] = {"authorization": {"credentials": token}}
        config = {
            "route": route,
            "receivers": [{"name": "controlplane", "webhook_configs": [webhook]}],
        }
        (self.home / "alertmanager.yml").write_text(json.dumps(config))  # JSON is valid YAML
        argv = [binary, f"--config.file={self.home / 'alertmanager.yml'}"]
        argv += [f"--storage.path={self.home / 'alertmanager-data'}"]
        argv += [f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="]
        state.alertmanager = self._spawn("alertmanager", argv, {"web": port})
        self._save(state)
        wait_http(f"http://127.0.0.1:{port}/-/ready", state.alertmanager)
        alerting = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}]}
        self._reload_prometheus(state, {"rule_files": [str(rules.resolve())], "alerting": alerting})
        return state.alertmanager

    def alerting_stop(self) -> None:
        """Alertmanager stopped, and Prometheus back to scraping only."""
        state = self.state()
        if state.alertmanager is not None:
            if state.alertmanager.running:
                os.killpg(state.alertmanager.pid, signal.SIGTERM)
                wait_gone(state.alertmanager, 15.0)
            state.alertmanager = None
            self._save(state)
        if state.prometheus is not None and state.prometheus.running:
            self._reload_prometheus(state, {"rule_files": [], "alerting": {}})

    def balancer(self, *, base_port: int | None = None) -> Proc:
        """HAProxy in front of the nodes: an HTTP and a gRPC (h2) frontend, each node a server
        of the backends `triton_http` and `triton_grpc` under its own name (weight 100, taken
        out while not ready), and its runtime API, admin level, on a local TCP port; on the
        three ports from `base_port`, or free ones."""
        state = self.state()
        if not state.nodes:
            raise DevfleetError("start the fleet first: HAProxy balances its nodes")
        binary = require_binary("haproxy", "apt-get install -y haproxy")
        if state.haproxy is not None and state.haproxy.running:
            raise DevfleetError(f"HAProxy is already running (pid {state.haproxy.pid})")
        for attempt in range(PORT_PICKS):  # free ports may be taken before HAProxy binds them
            http, grpc, runtime = ports_free(3, base_port)
            config = self.home / "haproxy.cfg"
            config.write_text(haproxy_config(state, http=http, grpc=grpc, runtime=runtime))
            argv = [binary, "-db", "-f", str(config)]
            check = subprocess.run([binary, "-c", "-q", "-f", str(config)], capture_output=True)
            if check.returncode != 0:
                raise DevfleetError(f"haproxy refused {config}: {check.stderr.decode().strip()}")
            state.haproxy = self._spawn(
                "haproxy", argv, {"http": http, "grpc": grpc, "runtime": runtime}
            )
            self._save(state)
            try:
                wait_http(f"http://127.0.0.1:{http}/v2/health/live", state.haproxy)
                break
            except PortTaken:
                if base_port is not None or attempt == PORT_PICKS - 1:
                    raise
        assert state.haproxy is not None
        return state.haproxy

    def _reload_prometheus(self, state: FleetState, changes: dict[str, object]) -> None:
        assert state.prometheus is not None
        config = self.home / "prometheus.yml"
        wanted = {k: v for k, v in (json.loads(config.read_text()) | changes).items() if v}
        config.write_text(json.dumps(wanted, indent=2))
        os.kill(state.prometheus.pid, signal.SIGHUP)

    def up_simulated(
        self,
        *,
        nodes: int,
        pool: str,
        base_port: int | None,
        load_ms: float,
        failure_rate: float,
    ) -> FleetState:
        """One simulator process serving `nodes` simulated nodes, for load tests; no Prometheus."""
        self._require_stopped()
        ports = ports_free(nodes, base_port)
        argv = [
            sys.executable,
            "-m",
            "apps.devtools.simulator",
            f"--ports={','.join(map(str, ports))}",
            f"--load-ms={load_ms}",
            f"--failure-rate={failure_rate}",
        ]
        names = [f"{pool}-{i + 1:03d}" for i in range(nodes)]
        proc = self._spawn("simulator", argv, dict(zip(names, ports, strict=True)), simulator_env())
        state = FleetState(simulator=proc)
        self._save(state)
        try:
            wait_simulator(proc)
        except BaseException:
            self.down()
            raise
        return state

    def _require_stopped(self) -> None:
        if any(proc.running for proc in self.state().processes):
            raise DevfleetError(
                f"a fleet is already running (see {self.state_file}); run `devfleet down` first"
            )

    def down(self, grace_s: float = 5.0) -> list[str]:
        """Stop what `up` started (`processes.stop`); returns one line per process."""
        lines = stop(self.state().processes, grace_s)
        self.state_file.unlink(missing_ok=True)
        return lines

    def kill(self, name: str) -> Proc:
        """SIGKILL one node, or Prometheus, as a crash would (for drills and tests)."""
        proc = self._proc(name)
        if proc.running:
            os.killpg(proc.pid, signal.SIGKILL)
            wait_gone(proc, 10.0)
        return proc

    def restart(self, name: str) -> Proc:
        """Start a stopped node (or Prometheus) again with its recorded command line and ports;
        Prometheus keeps the data it had."""
        state = self.state()
        old = self._proc(name)
        if old.running:
            raise DevfleetError(f"{name} is still running (pid {old.pid})")
        if state.prometheus is not None and name == state.prometheus.name:
            state.prometheus = proc = self._spawn(name, old.argv, old.ports)
            self._save(state)
            wait_http(f"{state.prometheus_url}/-/ready", proc)
            return proc
        if state.haproxy is not None and name == state.haproxy.name:
            state.haproxy = proc = self._spawn(name, old.argv, old.ports)
            self._save(state)
            wait_http(f"http://127.0.0.1:{proc.ports['http']}/v2/health/live", proc)
            return proc
        if state.simulator is not None and name == state.simulator.name:
            state.simulator = proc = self._spawn(name, old.argv, old.ports, simulator_env())
            self._save(state)
            wait_simulator(proc)
            return proc
        proc = self._spawn(name, old.argv, old.ports, triton_env())
        state.nodes = [proc if n.name == name else n for n in state.nodes]
        self._save(state)
        # On its recorded ports: the same node to the control plane.
        wait_http(f"http://127.0.0.1:{proc.ports['http']}/v2/health/live", proc)
        return proc

    def _proc(self, name: str) -> Proc:
        for proc in self.state().processes:
            if proc.name == name:
                return proc
        raise DevfleetError(f"no node or process named {name} in {self.state_file}")

    def _spawn(
        self, name: str, argv: list[str], ports: dict[str, int], env: dict[str, str] | None = None
    ) -> Proc:
        log = self.home / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        stat = proc_stat(popen.pid)
        started = int(stat[19]) if stat else -1
        return Proc(name=name, pid=popen.pid, argv=argv, log=str(log), started=started, ports=ports)

    def _start_prometheus(self, binary: str, port: int) -> Proc:
        targets = {"files": [str(self.targets.parent / "*.yml")], "refresh_interval": "1s"}
        scrape = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "triton", "file_sd_configs": [targets]}],
        }
        config = self.home / "prometheus.yml"
        config.write_text(json.dumps(scrape, indent=2))  # JSON is valid YAML
        data = self.home / "prometheus-data"
        shutil.rmtree(data, ignore_errors=True)
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=2d",
            "--web.enable-admin-api",
        ]
        return self._spawn("prometheus", argv, {"web": port})

    def _precompile(self) -> None:
        """Write the models' bytecode before Triton loads them. Otherwise the Python backend writes
        `<model>/<version>/__pycache__` during the load, the directory looks modified afterwards,
        and the next ensemble load re-reads that step from disk, dropping its config override
        (Triton's ModelRepositoryManager::PollModels / IsModified)."""
        subprocess.run(
            [f"/usr/bin/python{PYTHON_VERSION}", "-m", "compileall", "-q", str(self.repository)],
            check=True,
            capture_output=True,
        )

    def _triton_install(self) -> tuple[str, Path]:
        """tritonserver and a backend directory with the Python backend and the stub for the
        running interpreter's Python version (the stub embeds the system libpython)."""
        root = Path(pytriton.__file__).parent / "tritonserver"
        tritonserver = root / "bin" / "tritonserver"
        python = PYTHON_VERSION
        stub = root / "python_backend_stubs" / python / "triton_python_backend_stub"
        if not tritonserver.exists():
            raise DevfleetError(
                f"{tritonserver} is missing: reinstall the fleet extra (pip install -e '.[fleet]')"
            )
        if not stub.exists():
            raise DevfleetError(
                f"no Python backend stub for Python {python} in {stub.parent.parent}; use 3.11"
            )
        if not ctypes.util.find_library(f"python{python}"):
            raise DevfleetError(
                f"the stub needs the system libpython{python}: apt-get install -y libpython{python}"
            )
        system_numpy = subprocess.run(
            [f"/usr/bin/python{python}", "-I", "-c", "import numpy"], capture_output=True
        )
        if system_numpy.returncode != 0:
            raise DevfleetError(
                "the Python backend stub needs the system numpy: apt-get install -y python3-numpy"
            )
        backends = self.home / "backends" / "python"
        backends.mkdir(parents=True, exist_ok=True)
        for source in [*(root / "backends" / "python").iterdir(), stub]:
            link = backends / source.name
            link.unlink(missing_ok=True)
            link.symlink_to(source)
        return str(tritonserver), backends.parent

    # -- models ----------------------------------------------------------------------------------

    def fault(self, model: str, *, delay_ms: float = 0.0, error_rate: float = 0.0) -> None:
        """The demo models' runtime knob (deploy/ragkit): every version of `model`, on every node
        serving this repository, takes `delay_ms` more and fails `error_rate` more of its
        requests from its next request on, without a reload; zeros remove the fault."""
        path = self.repository.parent / "faults.json"
        faults = json.loads(path.read_text()) if path.exists() else {}
        faults.pop(model, None)
        if delay_ms or error_rate:
            faults[model] = {"delay_ms": delay_ms, "error_rate": error_rate}
        write_whole(path, json.dumps(faults))

    def load_release(self, client: TritonClient, model: str, version: int) -> None:
        """Load `model` at `version` from the repository; for an ensemble, its pinned steps first.
        Succeeds only when the repository index shows every loaded version READY."""
        release = read_model(self.repository, model)
        if version not in release.configs:
            raise DevfleetError(
                f"{model} has no version {version} in {self.repository} (has {release.versions})"
            )

        def resolve(name: str, pinned: int) -> Resolved:
            step = read_model(self.repository, name)
            number = pinned if pinned > 0 else max(step.versions)
            return Resolved(step.configs[number], number)

        steps = pinned_steps(release.configs[version], resolve)
        loads = [(name, number, config) for (name, number), config in steps.items()]
        loads.append((model, version, release.configs[version]))
        for name, each_version, config in loads:
            client.load(name, config_json=to_json(pin_versions(config, [each_version])))
        index = {(entry.model, entry.version): entry for entry in client.repository_index()}
        for name, each_version, _ in loads:
            entry = index.get((name, each_version))
            if entry is None or entry.state != "READY":
                reason = entry.reason if entry else "absent from the repository index"
                raise TritonError(
                    client.node, f"{name} v{each_version} is not READY after load: {reason}"
                )

"""The production artifacts under deploy/, checked by the tools that run them: promtool for the
Prometheus config and alerts (with a unit test of every alert), helm for the chart, systemd-analyze
for the units. Every command is the guide's, and every environment variable is one the app reads."""

import io
import ipaddress
import json
import re
import shlex
import shutil
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import call_command

from apps.devtools.processes import HAPROXY_BACKENDS, FleetState, Proc, haproxy_config
from apps.quality.models import EvaluationSet
from apps.rollouts.models import AnalysisTemplate
from tests.support.tools import run, tool

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS = DEPLOY / "prometheus"
CHART = DEPLOY / "helm" / "triton-controlplane"
UNITS = DEPLOY / "systemd"
INSTALL = "/opt/triton-controlplane/.venv/bin/"
REQUIRED_SECRETS = {"SECRET_KEY", "DATABASE_URL", "CELERY_BROKER_URL", "PROMETHEUS_URL"}
# A Slack webhook URL is a credential too, so it never goes into a ConfigMap.
OPTIONAL_SECRETS = {"ROLLOUT_WEBHOOK_URL", "MIGRATE_DATABASE_URL"}  # the owner, for migrations
# Read by the process command lines of the guide's "Run it" block, not by the app.
PROCESS_VARIABLES = {"BIND", "WEB_WORKERS", "WORKER_CONCURRENCY"}


def app_settings() -> set[str]:
    """The environment variables controlplane/settings.py reads."""
    source = (ROOT / "controlplane" / "settings.py").read_text()
    pattern = (
        r'(?:env_(?:str|bool|float|int|list|url|networks|header)|database_from_url)\(\s*"(\w+)"'
    )
    return set(re.findall(pattern, source))


def documented_commands() -> list[list[str]]:
    """The guide's "Run it" commands, less the venv prefix, `"${X:-default}"` read as `${X}`."""
    section = (DEPLOY / "README.md").read_text().split("## Run it", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "deploy/README.md has no commands under 'Run it'"
    lines = [line.removeprefix(".venv/bin/") for line in block[1].splitlines() if line.strip()]
    return [
        [re.sub(r"\$\{(\w+):-[^}]*\}", r"${\1}", word) for word in shlex.split(line)]
        for line in lines
    ]


def test_the_settings_collector_finds_the_secrets_the_app_reads() -> None:
    assert app_settings() >= REQUIRED_SECRETS | OPTIONAL_SECRETS


# Prometheus


def test_promtool_accepts_the_config_once_its_token_file_exists(tmp_path: Path) -> None:
    """The scrape config names the control plane's token file, which a deployment provides."""
    copy = shutil.copytree(PROMETHEUS, tmp_path / "prometheus")
    result = run(tool("promtool"), "check", "config", str(copy / "prometheus.yml"))
    assert result.returncode != 0 and "controlplane.token" in result.stdout + result.stderr
    (copy / "controlplane.token").write_text("tcp_example\n")
    result = run(tool("promtool"), "check", "config", str(copy / "prometheus.yml"))  # targets too
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ("check", "rules", "deploy/prometheus/alerts.yml"),
        ("test", "rules", "deploy/prometheus/alerts_test.yml"),
    ],
    ids=["rules", "rule-tests"],
)
def test_promtool_accepts_the_prometheus_files(argv: tuple[str, ...]) -> None:
    result = run(tool("promtool"), *argv)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not() -> None:
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    cases = [case for test in tests for case in test["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    quiet = {case["alertname"] for case in cases if not case["exp_alerts"]}
    assert alerts <= fired, f"never seen firing: {alerts - fired}"
    assert alerts <= quiet, f"never seen quiet: {alerts - quiet}"


def test_every_triton_target_names_its_node_and_pool() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # The alerts select `up{job="triton"}` and `up{job="controlplane"}`.
    assert set(jobs) == {"triton", "controlplane"}
    assert jobs["controlplane"]["metrics_path"] == "/metrics"
    assert config["rule_files"] == ["alerts.yml"]
    patterns = [name for sd in jobs["triton"]["file_sd_configs"] for name in sd["files"]]
    files = [path for pattern in patterns for path in PROMETHEUS.glob(pattern)]
    assert files, f"no targets file matches {patterns}"
    for path in files:
        for group in json.loads(path.read_text()):
            # Group labels apply to every target in the group, and each node has its own name.
            assert len(group["targets"]) == 1, group
            assert {"node", "pool"} <= set(group["labels"]), group


# Helm


@cache
def rendered(*values: str) -> tuple[dict[str, Any], ...]:
    argv = ["template", "cp", str(CHART)]
    for value in values:
        argv += ["--set", value]
    result = run(tool("helm"), *argv)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(kind: str, *values: str) -> list[dict[str, Any]]:
    return [doc for doc in rendered(*values) if doc["kind"] == kind]


def workloads(*values: str) -> dict[str, dict[str, Any]]:
    """Deployments and Jobs by their component label."""
    docs = of_kind("Deployment", *values) + of_kind("Job", *values)
    return {doc["metadata"]["labels"]["app.kubernetes.io/component"]: doc for doc in docs}


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def command(workload: dict[str, Any], index: int = -1) -> list[str]:
    return [str(word) for word in containers(workload)[index]["command"]]


def documented(program: str, *words: str) -> list[str]:
    [found] = [
        c for c in documented_commands() if c[0] == program and c[1 : 1 + len(words)] == list(words)
    ]
    return found


@pytest.mark.parametrize(
    "values",
    [
        (),
        (
            "ingress.enabled=true",
            "worker.queues[0].name=eu-west",
            "networkPolicy.fleetCIDRs={10.40.0.0/16,fd00:40::/48}",
        ),
        ("networkPolicy.enabled=false", "web.trustedProxies=2", "migrations.appRole=cp_app"),
    ],
)
def test_the_chart_lints_cleanly(values: tuple[str, ...]) -> None:
    result = run(tool("helm"), "lint", "--strict", str(CHART), *[f"--set={v}" for v in values])
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_renders_web_workers_beat_migrations_a_service_and_config() -> None:
    kinds = Counter(doc["kind"] for doc in rendered())
    assert kinds == {
        "Deployment": 4,
        "Job": 1,
        "Service": 1,
        "ConfigMap": 1,
        "PodDisruptionBudget": 1,
        "NetworkPolicy": 3,
    }
    assert set(workloads()) == {"web", "worker", "worker-rollouts", "beat", "migrate"}


def test_web_runs_the_guides_gunicorn_with_probes_on_healthz_and_readyz() -> None:
    web = workloads("web.workers=7", "host=cp.example.org")["web"]
    expected = documented("gunicorn")
    expected[expected.index("${BIND}")] = "0.0.0.0:8000"
    expected[expected.index("${WEB_WORKERS}")] = "7"
    assert command(web) == expected
    [container] = containers(web)
    assert container["ports"] == [{"name": "http", "containerPort": 8000}]
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
        get = container[probe]["httpGet"]
        assert (get["path"], get["port"]) == (path, "http")
        # Django refuses a Host it does not allow; the kubelet's would be the pod's IP.
        assert get["httpHeaders"] == [{"name": "Host", "value": "cp.example.org"}]
    [config] = of_kind("ConfigMap", "web.workers=7", "host=cp.example.org")
    assert config["data"]["ALLOWED_HOSTS"] == "cp.example.org"


def test_the_service_sends_to_the_web_pods() -> None:
    [service] = of_kind("Service")
    web = workloads()["web"]
    assert service["spec"]["selector"] == web["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_beat_is_one_replica_never_two_even_during_an_upgrade() -> None:
    beat = workloads("web.replicas=5", "worker.replicas=5")["beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"] == {"type": "Recreate"}
    assert command(beat) == documented("celery", "-A", "controlplane", "beat")


def test_workers_spread_over_hosts_and_each_routed_queue_gets_its_own() -> None:
    found = workloads(
        "worker.replicas=6",
        "worker.concurrency=8",
        "worker.queues[0].name=eu-west",
        "worker.queues[0].replicas=2",
        "worker.queues[0].nodeSelector.region=eu-west",
    )
    worker, regional = found["worker"], found["worker-eu-west"]
    expected = documented("celery", "-A", "controlplane", "worker")
    expected[expected.index("${WORKER_CONCURRENCY}")] = "8"
    assert command(worker) == expected
    assert command(regional) == [*expected, "--queues", "eu-west"]
    assert (worker["spec"]["replicas"], regional["spec"]["replicas"]) == (6, 2)
    assert regional["spec"]["template"]["spec"]["nodeSelector"] == {"region": "eu-west"}
    for deployment in (worker, regional):
        pod = deployment["spec"]["template"]
        [spread] = pod["spec"]["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"] == pod["metadata"]["labels"]


def test_migrations_run_as_a_hook_before_install_and_upgrade_then_roles() -> None:
    job = workloads()["migrate"]
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert command(job, 0) == documented("python", "manage.py", "migrate")
    assert command(job, 1) == documented("python", "manage.py", "setup_roles")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    # A pre-install hook runs before the ConfigMap exists: it must not depend on it.
    assert all("envFrom" not in container for container in containers(job))


def test_with_an_application_role_the_owner_grants_it_after_each_migrate() -> None:
    assert [c["name"] for c in containers(workloads()["migrate"])] == ["migrate", "setup-roles"]
    job = workloads("migrations.appRole=cp_app")["migrate"]
    assert [c["name"] for c in containers(job)] == ["migrate", "grant-app-role", "setup-roles"]
    grant = ["python", "manage.py", "grant_app_role", "--role", "cp_app"]
    assert command(job, 1) == [*grant, "--password-env", "APP_DB_PASSWORD"]
    env = {item["name"]: item for item in containers(job)[1]["env"]}
    assert env["DATABASE_AS_OWNER"]["value"] == "true"
    for name in ("MIGRATE_DATABASE_URL", "APP_DB_PASSWORD"):  # required: the owner grants
        assert not env[name]["valueFrom"]["secretKeyRef"].get("optional"), name


def test_the_ingress_is_optional_and_serves_the_host_over_tls() -> None:
    assert of_kind("Ingress") == []
    [ingress] = of_kind("Ingress", "ingress.enabled=true", "host=cp.example.org")
    [service] = of_kind("Service", "ingress.enabled=true", "host=cp.example.org")
    assert ingress["spec"]["tls"][0]["hosts"] == ["cp.example.org"]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "cp.example.org"
    backend = rule["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]


def test_the_ingress_takes_its_class_and_can_go_without_tls() -> None:
    [ingress] = of_kind("Ingress", "ingress.enabled=true", "ingress.className=nginx")
    assert ingress["spec"]["ingressClassName"] == "nginx"
    [plain] = of_kind("Ingress", "ingress.enabled=true", "ingress.tls.enabled=false")
    assert "tls" not in plain["spec"] and "ingressClassName" not in plain["spec"]


def trusted_proxies(*values: str) -> str:
    [container] = containers(workloads(*values)["web"])
    return {env["name"]: env.get("value") for env in container["env"]}["TRUSTED_PROXIES"]


def test_the_web_trusts_the_ingress_controller_as_the_proxy_in_front_and_no_more() -> None:
    assert trusted_proxies("ingress.enabled=true") == "1"
    # Without the chart's Ingress nothing is known in front: X-Forwarded-For is anyone's to write.
    assert trusted_proxies() == "0"
    assert trusted_proxies("ingress.enabled=true", "web.trustedProxies=2") == "2"
    assert trusted_proxies("ingress.enabled=true", "web.trustedProxies=0") == "0"


def pods(*values: str) -> dict[str, dict[str, Any]]:
    return {name: w["spec"]["template"] for name, w in workloads(*values).items()}


def test_every_pod_meets_pod_security_restricted() -> None:
    found = pods("worker.queues[0].name=eu-west")
    assert {"web", "worker", "worker-rollouts", "worker-eu-west", "beat", "migrate"} <= set(found)
    for name, pod in found.items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["securityContext"]["runAsUser"] != 0, name
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (name, container["name"])
            assert context["runAsNonRoot"] is True, (name, container["name"])
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, name
            assert not context.get("privileged"), name


def test_drains_take_one_web_pod_at_a_time() -> None:
    [budget] = of_kind("PodDisruptionBudget", "web.replicas=3")
    web = workloads("web.replicas=3")["web"]
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"] == web["spec"]["selector"]["matchLabels"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for rule in selector.get("matchExpressions", []):
        inside = labels.get(rule["key"]) in rule["values"]
        if inside != (rule["operator"] == "In"):
            return False
    return True


def allowed(policies: list[dict[str, Any]], labels: dict[str, str], kind: str, ip: str) -> bool:
    """What NetworkPolicy lets a pod do: all until a policy of the kind selects it, then only
    what one of their rules allows (by address; ports are not looked at here)."""
    chosen = [
        p["spec"]
        for p in policies
        if selects(p["spec"]["podSelector"], labels) and kind in p["spec"]["policyTypes"]
    ]
    if not chosen:
        return True
    peers = "to" if kind == "Egress" else "from"
    address = ipaddress.ip_address(ip)
    for spec in chosen:
        for rule in spec.get(kind.lower(), []):
            if peers not in rule:
                return True  # a rule naming no peers allows every address
            for peer in rule[peers]:
                block = peer.get("ipBlock")
                if block is None:
                    continue
                network = ipaddress.ip_network(block["cidr"])
                if address.version != network.version or address not in network:
                    continue
                if not any(address in ipaddress.ip_network(e) for e in block.get("except", [])):
                    return True
    return False


def test_only_the_workers_reach_the_triton_nodes_and_haproxy() -> None:
    values = (
        "networkPolicy.fleetCIDRs={10.40.0.0/16,fd00:40::/48}",
        "worker.queues[0].name=eu-west",
    )
    policies = of_kind("NetworkPolicy", *values)
    labels = {name: pod["metadata"]["labels"] for name, pod in pods(*values).items()}
    for name, pod_labels in labels.items():
        reaches_fleet = [
            allowed(policies, pod_labels, "Egress", ip) for ip in ("10.40.3.7", "fd00:40::7")
        ]
        assert reaches_fleet == [name.startswith("worker")] * 2, name
        # PostgreSQL, Redis and Prometheus outside the fleet's networks: everyone.
        assert allowed(policies, pod_labels, "Egress", "10.0.5.5"), name
        # Only the web takes connections (the Ingress controller, the probes, Prometheus).
        assert allowed(policies, pod_labels, "Ingress", "10.0.9.9") == (name == "web"), name
    [web_in] = [
        p
        for p in policies
        if selects(p["spec"]["podSelector"], labels["web"])
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert web_in["spec"]["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    assert of_kind("NetworkPolicy", "networkPolicy.enabled=false") == []


def test_every_variable_the_chart_sets_is_a_setting_the_app_reads() -> None:
    values = ("worker.queues[0].name=eu-west", "config.SECURE_SSL_REDIRECT=true")
    [config] = of_kind("ConfigMap", *values)
    settings = app_settings()
    assert set(config["data"]) - settings == set()
    assert set(config["data"]) & (REQUIRED_SECRETS | OPTIONAL_SECRETS) == set()
    for name, workload in workloads(*values).items():
        for container in containers(workload):
            names = {env["name"] for env in container["env"]}
            assert names - settings == set(), name
            refs = [ref["configMapRef"]["name"] for ref in container.get("envFrom", [])]
            assert refs in ([], [config["metadata"]["name"]]), name


def test_secrets_come_by_reference_from_the_existing_secret_only() -> None:
    values = ("existingSecret=prod-controlplane", "worker.queues[0].name=eu-west")
    assert of_kind("Secret", *values) == []
    for name, workload in workloads(*values).items():
        for container in containers(workload):
            env = {item["name"]: item for item in container["env"]}
            refs = {n: e["valueFrom"]["secretKeyRef"] for n, e in env.items() if "valueFrom" in e}
            assert {ref["name"] for ref in refs.values()} == {"prod-controlplane"}, name
            assert all(ref["key"] == n for n, ref in refs.items()), name
            assert {n for n, ref in refs.items() if not ref.get("optional")} == REQUIRED_SECRETS
            assert set(refs) - REQUIRED_SECRETS <= OPTIONAL_SECRETS, name


def test_every_process_takes_its_image_and_resources_from_values() -> None:
    values = (
        "image.repository=reg.example.org/cp",
        "image.tag=1.2.3",
        "web.resources.limits.memory=3Gi",
    )
    found = workloads(*values)
    for name, workload in found.items():
        for container in containers(workload):
            assert container["image"] == "reg.example.org/cp:1.2.3", name
            assert {"requests", "limits"} <= set(container["resources"]), name
    assert containers(found["web"])[0]["resources"]["limits"]["memory"] == "3Gi"


# systemd


def unit(name: str) -> dict[str, dict[str, list[str]]]:
    """A unit file's sections, each key with its values in order (ExecStart may repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    section: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = sections.setdefault(line.strip("[]"), {})
        else:
            key, _, value = line.partition("=")
            section.setdefault(key.strip(), []).append(value.strip())
    return sections


SERVICES = ["controlplane-web.service", "controlplane-worker@.service", "controlplane-beat.service"]
UNIT_FILES = ["controlplane-migrate.service", *SERVICES]


def exec_starts(name: str) -> list[list[str]]:
    commands = unit(name)["Service"]["ExecStart"]
    assert all(c.startswith(INSTALL) for c in commands), commands
    return [shlex.split(c.removeprefix(INSTALL)) for c in commands]


def test_the_units_run_the_commands_of_the_guide() -> None:
    guide = documented_commands()
    assert exec_starts("controlplane-migrate.service") == guide[:3]
    assert exec_starts("controlplane-web.service") == [documented("gunicorn")]
    assert exec_starts("controlplane-beat.service") == [
        documented("celery", "-A", "controlplane", "beat")
    ]
    worker = documented("celery", "-A", "controlplane", "worker")
    # The instance is the queue: controlplane-worker@celery, controlplane-worker@eu-west.
    assert exec_starts("controlplane-worker@.service") == [
        [*worker, "--queues", "%i", "--hostname", "%i@%H"]
    ]


def test_the_services_start_only_after_migrate_succeeded() -> None:
    assert unit("controlplane-migrate.service")["Service"]["Type"] == ["oneshot"]
    for name in SERVICES:
        sections = unit(name)
        for key in ("After", "Requires"):
            words = " ".join(sections["Unit"][key]).split()
            assert "controlplane-migrate.service" in words, (name, key)
        assert sections["Service"]["Restart"] == ["on-failure"], name


@pytest.mark.parametrize("name", UNIT_FILES)
def test_every_unit_runs_unprivileged_from_the_install_with_the_env_file(name: str) -> None:
    service = unit(name)["Service"]
    expected = {
        "User": ["controlplane"],
        "WorkingDirectory": ["/opt/triton-controlplane"],
        "EnvironmentFile": ["/etc/triton-controlplane/controlplane.env"],
        "NoNewPrivileges": ["yes"],
        "ProtectSystem": ["strict"],
        "PrivateTmp": ["yes"],
    }
    assert {key: service.get(key) for key in expected} == expected


@pytest.mark.parametrize("name", UNIT_FILES)
def test_every_variable_a_command_uses_has_a_default_in_its_unit(name: str) -> None:
    service = unit(name)["Service"]
    used = set(re.findall(r"\$\{(\w+)\}", " ".join(service["ExecStart"])))
    defaults = {
        word.split("=")[0] for line in service.get("Environment", []) for word in line.split()
    }
    assert used <= PROCESS_VARIABLES
    assert used <= defaults


def test_the_example_environment_names_only_what_the_app_or_the_units_read() -> None:
    text = (UNITS / "controlplane.env.example").read_text()
    names = set(re.findall(r"^#?([A-Z][A-Z0-9_]*)=", text, re.M))
    assert names >= REQUIRED_SECRETS
    assert names - app_settings() - PROCESS_VARIABLES == set()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_analyze_verifies_the_units() -> None:
    paths = [UNITS / n for n in UNIT_FILES if "@." not in n]
    paths += [
        UNITS / "controlplane-worker@celery.service",
        UNITS / "controlplane-worker@eu-west.service",
    ]
    result = run("systemd-analyze", "verify", "--man=no", *map(str, paths))
    # The one complaint allowed: the app is not installed under /opt on this machine.
    missing = re.compile(rf"^[\w@.-]+: Command {re.escape(INSTALL)}\w+ is not executable: ")
    problems = [line for line in result.stderr.splitlines() if not missing.match(line)]
    assert problems == [], result.stderr


# HAProxy in front of a pool ----------------------------------------------------------------


def test_haproxy_accepts_the_example_pool_config() -> None:
    result = run(tool("haproxy"), "-c", "-f", str(DEPLOY / "haproxy" / "triton-pool.cfg"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_haproxy_accepts_the_demo_fleets_config_with_every_node_in_both_backends(
    tmp_path: Path,
) -> None:
    nodes = [
        Proc(f"demo-{i}", 0, [], "", 0, {"http": 8100 + i, "grpc": 8200 + i, "metrics": 1})
        for i in (1, 2)
    ]
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(FleetState(nodes=nodes), http=9000, grpc=9001, runtime=9002))
    result = run(tool("haproxy"), "-c", "-f", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    text = config.read_text()
    for backend in HAPROXY_BACKENDS:
        servers = text.split(f"\nbackend {backend}\n", 1)[1].split("\nbackend ", 1)[0]
        assert re.findall(r"^    server (\S+)", servers, re.M) == ["demo-1", "demo-2"]
    assert "stats socket ipv4@127.0.0.1:9002 level admin" in text


# What `make demo` runs before the fleet starts: every such line must parse and succeed.
DEMO_SETUP = ("setup_roles", "import_repository", "set_budgets", "set_fallback", "set_slo")
DEMO_SETUP += (
    "import_evaluation_set",
    "import_evaluation_set",
    "analysis_template",
    "analysis_template",
)


@pytest.mark.django_db
def test_the_demos_setup_commands_run_as_the_script_writes_them() -> None:
    script = (ROOT / "deploy" / "bin" / "demo").read_text()
    lines = re.findall(r"^\$py manage\.py (.+)$", script, re.M)
    ran = []
    for line in lines:
        words = [w for w in shlex.split(line, comments=True) if not w.startswith(">")]
        if words[0] in DEMO_SETUP:
            call_command(*words, stdout=io.StringIO())
            ran.append(words[0])
    assert ran == list(DEMO_SETUP)
    assert EvaluationSet.objects.filter(name="faq").count() == 2  # the pipeline's, the retriever's
    template = AnalysisTemplate.objects.get(name="answers")
    assert template.analysis == {"quality_set": "faq", "quality_every": 3, "synthetic_rps": 2}

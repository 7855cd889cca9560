"""All settings come from the environment; defaults run the local demo with zero setup."""

import os
from datetime import timedelta
from pathlib import Path

import plotly
from csp.constants import NONCE, SELF
from django.core.exceptions import ImproperlyConfigured

from controlplane.env import (
    database_from_url,
    env_bool,
    env_float,
    env_header,
    env_int,
    env_list,
    env_networks,
    env_str,
    env_url,
)
from controlplane.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = BASE_DIR / "var"

DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is false.")
    SECRET_KEY = "insecure-local-demo-key-only-for-debug"  # noqa: S105
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost"])

DATABASES = {"default": database_from_url("DATABASE_URL", "sqlite:///var/db.sqlite3", BASE_DIR)}
# Migrations (the migrate unit, the migrations Job) run as the schema's owner, MIGRATE_DATABASE_URL
# where DATABASE_AS_OWNER=true; web and workers connect as a role that may append to the audit
# trail but never rewrite it (deploy/README.md, "Database roles").
if env_bool("DATABASE_AS_OWNER", False) and os.environ.get("MIGRATE_DATABASE_URL"):
    DATABASES = {"default": database_from_url("MIGRATE_DATABASE_URL", "", BASE_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CELERY_BROKER_URL = env_url("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0", ("redis", "rediss"))

# PRODUCTION=true: the defaults that let the demo run with zero setup become errors.
PRODUCTION = env_bool("PRODUCTION", False)
if PRODUCTION:
    if DEBUG:
        raise ImproperlyConfigured("PRODUCTION=true with DEBUG=true: unset DEBUG.")
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise ImproperlyConfigured(
            "PRODUCTION=true needs PostgreSQL: set DATABASE_URL=postgres://user@host/database "
            "(SQLite is the demo's)."
        )
    if "CELERY_BROKER_URL" not in os.environ:
        raise ImproperlyConfigured(
            "PRODUCTION=true needs Redis named explicitly: set CELERY_BROKER_URL=redis://host:6379/0."
        )
PROMETHEUS_URL = env_url("PROMETHEUS_URL", "http://127.0.0.1:9090", ("http", "https"))
# A CA file for an https:// Prometheus signed by a private authority; empty: the system's.
PROMETHEUS_CA_BUNDLE = env_str("PROMETHEUS_CA_BUNDLE", "")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_htmx",
    "template_partials",
    "csp",
    "django_celery_beat",
    "axes",
    "apps.audit",
    "apps.prometheus",
    "apps.web",
    "apps.accounts",
    "apps.registry",
    "apps.fleet",
    "apps.quality",
    "apps.observability",
    "apps.performance",
    "apps.rollouts",
    "apps.approvals",
    "apps.degradation",
    "apps.scaling",
    "apps.incidents",
    "apps.api",
    "apps.retention",
    "apps.statefiles",
    "apps.devtools",  # the local fleet, simulator, load generator, seeding: no app imports it
    "ninja",  # the API docs' own static files (Swagger UI): no CDN
]

MIDDLEWARE = [
    "apps.audit.context.RequestIdMiddleware",  # first: every response names its request
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # collected static files, before the session
    "django.contrib.sessions.middleware.SessionMiddleware",
    "apps.web.sessions.IdleSessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "apps.web.guard.RequestGuardMiddleware",  # before CSRF reads the form
    "apps.web.nul.RejectNulMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "apps.accounts.permissions.RoleRequiredMiddleware",
    "apps.web.guard.ReadOnlyPagesMiddleware",
    "apps.approvals.middleware.ApprovalMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    "csp.middleware.CSPMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes wants
]
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # refuses a locked-out sign-in before the password
    "django.contrib.auth.backends.ModelBackend",
]
# AXES_FAILURE_LIMIT failed sign-ins for one user from one address lock that pair out for
# AXES_COOLOFF_MINUTES (a per-user lock alone would let anyone lock the admins out), and
# AXES_ADDRESS_FAILURE_LIMIT from one address, whichever users they named, lock the address
# (one client guessing a few passwords of every user): apps/web/throttle.py.
AXES_FAILURE_LIMIT = env_int("AXES_FAILURE_LIMIT", 5)
AXES_ADDRESS_FAILURE_LIMIT = env_int("AXES_ADDRESS_FAILURE_LIMIT", 30)
if AXES_ADDRESS_FAILURE_LIMIT < AXES_FAILURE_LIMIT:
    raise ImproperlyConfigured(
        f"AXES_ADDRESS_FAILURE_LIMIT={AXES_ADDRESS_FAILURE_LIMIT} is below "
        f"AXES_FAILURE_LIMIT={AXES_FAILURE_LIMIT}: an address's limit covers all its users."
    )
AXES_COOLOFF_TIME = timedelta(minutes=env_float("AXES_COOLOFF_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_HANDLER = "apps.web.throttle.AddressThrottleHandler"
AXES_RESET_ON_SUCCESS = True
AXES_DISABLE_ACCESS_LOG = True  # the audit trail records what matters; this table only grows
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_VERBOSE = False
# Behind TRUSTED_PROXIES reverse proxies, the client is the address they saw (X-Forwarded-For).
TRUSTED_PROXIES = env_int("TRUSTED_PROXIES", 0)
AXES_CLIENT_IP_CALLABLE = "apps.web.guard.client_ip"

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"
LOGIN_URL = "accounts:login"
LOGIN_REDIRECT_URL = "fleet:overview"
LOGOUT_REDIRECT_URL = "accounts:login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "csp.context_processors.nonce",
            ],
            "builtins": ["apps.web.times"],
        },
    }
]

AUTH_PASSWORD_VALIDATORS = [
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 12},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(VAR_DIR / "static")))
# plotly.js is served from the installed plotly package: no CDN, and always the matching version.
STATICFILES_DIRS = [
    BASE_DIR / "static",
    ("plotly", Path(plotly.__file__).parent / "package_data"),
]

CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF, NONCE],
        # Plotly and htmx set inline style attributes on the elements they draw.
        "style-src": [SELF, "'unsafe-inline'"],
        "img-src": [SELF, "data:"],
        "frame-ancestors": ["'none'"],
        # No <base> may move relative URLs elsewhere; forms post only back to this site.
        "base-uri": ["'none'"],
        "form-action": [SELF],
    }
}

# A repository archive (registry.archives.MAX_UPLOAD_BYTES) and its multipart framing fit.
REQUEST_BODY_MAX_BYTES = int(env_float("REQUEST_BODY_MAX_BYTES", 21 * 2**20))

# A session ends after SESSION_IDLE_S without a request of a person (a live part's poll is not
# one), and SESSION_MAX_AGE_S after sign-in however active (apps/web/sessions.py: to the
# minute, writing the session once a minute at most).
SESSION_COOKIE_AGE = int(env_float("SESSION_IDLE_S", 3600))
SESSION_MAX_AGE_S = int(env_float("SESSION_MAX_AGE_S", 12 * 3600))
SESSION_TOUCH_S = 60
# API tokens expire after at most this many days (each token may choose fewer).
API_TOKEN_MAX_DAYS = int(env_float("API_TOKEN_MAX_DAYS", 90))
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE = env_bool("SECURE_COOKIES", not DEBUG)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
# Probes and scrapers may come over plain HTTP from inside the cluster or host.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = 0 if DEBUG else 31536000
SECURE_HSTS_INCLUDE_SUBDOMAINS = not DEBUG
SECURE_HSTS_PRELOAD = not DEBUG
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# Celery: acknowledge after the work is done, so a killed worker's task is redelivered; the
# visibility timeout outlives every task's hard time limit, so Redis never redelivers a live task.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = 60
CELERY_TASK_TIME_LIMIT = 90
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 600}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_IGNORE_RESULT = True
CELERY_TIMEZONE = "UTC"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
FLEET_POLL_INTERVAL_S = env_float("FLEET_POLL_INTERVAL_S", 5.0)
FLEET_RECONCILE_INTERVAL_S = env_float("FLEET_RECONCILE_INTERVAL_S", 10.0)
ROLLOUT_TICK_S = env_float("ROLLOUT_TICK_S", 2.0)
# Degradation tiers (apps/degradation): judged every DEGRADATION_TICK_S over a short and a long
# window, each with at least DEGRADATION_MIN_REQUESTS; more switches than this an hour freeze it.
DEGRADATION_TICK_S = env_float("DEGRADATION_TICK_S", 5.0)
DEGRADATION_SHORT_S = env_int("DEGRADATION_SHORT_S", 30)
DEGRADATION_LONG_S = env_int("DEGRADATION_LONG_S", 120)
DEGRADATION_MIN_REQUESTS = env_int("DEGRADATION_MIN_REQUESTS", 20)
DEGRADATION_MAX_SWITCHES_PER_HOUR = env_int("DEGRADATION_MAX_SWITCHES_PER_HOUR", 2)
# Saturated: the pipeline's requests and its steps' waited in queues this many times longer than
# they computed, in both windows (or Triton rejected some: a queue full).
DEGRADATION_MAX_QUEUE_RATIO = env_float("DEGRADATION_MAX_QUEUE_RATIO", 4.0)
# Back up a tier only once the budget has held this long at the lower one (far longer than a
# step down's windows; and past the 60 s that Triton's P99 summaries keep a request), and the
# tier above has answered DEGRADATION_PROBES requests on each of DEGRADATION_PROBE_NODES nodes
# within budget: one round of probes a dwell at most.
DEGRADATION_DWELL_UP_S = env_int("DEGRADATION_DWELL_UP_S", 600)
# After a step down, a breach decides nothing this long: Triton keeps a request in its P99 summary
# 60 s and labels every version of an ensemble alike, so the readings still hold the tier before.
DEGRADATION_SETTLE_S = env_int("DEGRADATION_SETTLE_S", 70)
DEGRADATION_PROBES = env_int("DEGRADATION_PROBES", 20)
DEGRADATION_PROBE_NODES = env_int("DEGRADATION_PROBE_NODES", 3)
# Discovery (apps/fleet/discovery.py): nodes are the targets of this Prometheus scrape pool (empty:
# only nodes registered by hand), read every DISCOVERY_INTERVAL_S; a node's pool and name are
# target labels, its HTTP and gRPC ports these (or the target's `http_port`/`grpc_port` labels);
# a node whose target is gone this long, over passes that did not list it, has departed (at most
# DISCOVERY_DEPARTURES_PER_PASS a pass: a listing that lost many targets at once departs them over
# several passes, and the trail says so meanwhile).
DISCOVERY_SCRAPE_POOL = env_str("DISCOVERY_SCRAPE_POOL", "")
DISCOVERY_INTERVAL_S = env_float("DISCOVERY_INTERVAL_S", 5.0)
DISCOVERY_POOL_LABEL = env_str("DISCOVERY_POOL_LABEL", "pool")
DISCOVERY_NAME_LABEL = env_str("DISCOVERY_NAME_LABEL", "node")
DISCOVERY_HTTP_PORT = env_int("DISCOVERY_HTTP_PORT", 8000)
DISCOVERY_GRPC_PORT = env_int("DISCOVERY_GRPC_PORT", 8001)
DISCOVERY_GRACE_S = env_float("DISCOVERY_GRACE_S", 120.0)
DISCOVERY_DEPARTURES_PER_PASS = env_int("DISCOVERY_DEPARTURES_PER_PASS", 100)
# The nodes each pool needs (apps/scaling), computed every SCALING_TICK_S from the last
# SCALING_WINDOW_S of Prometheus: each served release at SCALING_TARGET_LOAD of its measured
# capacity a node, the worst step's queue time at most SCALING_QUEUE_RATIO of its compute time
# (Triton's Kubernetes recipe), the GPUs at SCALING_GPU_UTILIZATION.
SCALING_TICK_S = env_float("SCALING_TICK_S", 15.0)
SCALING_WINDOW_S = env_float("SCALING_WINDOW_S", 60.0)
SCALING_TARGET_LOAD = env_float("SCALING_TARGET_LOAD", 0.8)
SCALING_QUEUE_RATIO = env_float("SCALING_QUEUE_RATIO", 1.0)
SCALING_GPU_UTILIZATION = env_float("SCALING_GPU_UTILIZATION", 0.7)
# /readyz wants a heartbeat that went from beat through a worker to the database this recently.
HEARTBEAT_INTERVAL_S = 10.0
READY_HEARTBEAT_MAX_AGE_S = env_float("READY_HEARTBEAT_MAX_AGE_S", 60.0)
CELERY_BEAT_SCHEDULE = {
    "heartbeat": {"task": "fleet.heartbeat", "schedule": HEARTBEAT_INTERVAL_S},
    "poll-nodes": {"task": "fleet.poll_nodes", "schedule": FLEET_POLL_INTERVAL_S},
    "discover": {"task": "fleet.discover", "schedule": DISCOVERY_INTERVAL_S},
    "reconcile": {"task": "fleet.reconcile_all", "schedule": FLEET_RECONCILE_INTERVAL_S},
    "rollouts": {"task": "rollouts.advance_all", "schedule": ROLLOUT_TICK_S},
    "degradation": {"task": "degradation.tick_all", "schedule": DEGRADATION_TICK_S},
    "scaling": {"task": "scaling.tick", "schedule": SCALING_TICK_S},
    "retention": {"task": "retention.prune", "schedule": 3600.0},
    "lost-notifications": {"task": "rollouts.deliver_lost", "schedule": 60.0},
    "unsent-evaluations": {"task": "quality.resend_queued", "schedule": 60.0},
}
# What the fleet and rollouts leave behind goes after RETENTION_DAYS (RETENTION_<KIND>_DAYS for
# one kind; 0 keeps it), RETENTION_BATCH rows per transaction (apps/retention). Expired sessions
# always go; the audit trail stays, by month (apps/audit/partitions.py).
RETENTION_DAYS = env_int("RETENTION_DAYS", 90)
RETENTION_DAYS_BY_KIND = {
    kind: env_int(f"RETENTION_{kind.upper()}_DAYS", RETENTION_DAYS)
    for kind in (
        "departed",
        "operations",
        "measurements",
        "notifications",
        "approvals",
        "answers",
        "logins",
    )
}
RETENTION_BATCH = 1000
# Slack-compatible webhook told about rollouts (start, steps, pauses, failures, rollbacks,
# success) and the degradation automation's switches and freezes; empty: none. Links in its
# messages start with SITE_URL.
ROLLOUT_WEBHOOK_URL = env_str("ROLLOUT_WEBHOOK_URL", "")
# How long a change to a protected pool waits for its second person.
APPROVAL_TTL_S = env_float("APPROVAL_TTL_S", 3600.0)
SITE_URL = env_str("SITE_URL", "http://127.0.0.1:8000").rstrip("/")

# Local model repositories whose files a release download may include (artifacts are free text).
REGISTRY_ARTIFACT_ROOTS = env_list("REGISTRY_ARTIFACT_ROOTS", [str(BASE_DIR / "deploy" / "models")])

# Nodes are contacted only at addresses inside these networks (never link-local or metadata
# addresses): by default loopback and the private ranges.
NODE_ALLOWED_NETWORKS = env_networks(
    "NODE_ALLOWED_NETWORKS",
    [
        "127.0.0.0/8",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "::1/128",
        "fc00::/7",
    ],
)
# https:// nodes signed by a private authority: its CA file; empty: the system's authorities.
TRITON_CA_BUNDLE = env_str("TRITON_CA_BUNDLE", "")
# Nodes started with --http-restricted-api=model-repository:NAME=VALUE want this header,
# "NAME: VALUE", on every repository call (index, load, unload); empty: none.
TRITON_REPOSITORY_HEADER = env_header("TRITON_REPOSITORY_HEADER")
# Triton's perf_analyzer, which measures a version before traffic (apps/performance/analyzer.py);
# `make` installs one that runs on Debian 12 as `perf-analyzer` (deploy/bin/os-deps).
PERF_ANALYZER = env_str("PERF_ANALYZER", "perf-analyzer")

FLEET_UNREACHABLE_AFTER = 3
# A flapping node: past FLEET_FLAP_LIMIT up/down events within the window, changes are counted,
# not recorded, until the node holds a state for FLEET_FLAP_SETTLE_S.
FLEET_FLAP_LIMIT = 4
FLEET_FLAP_WINDOW_S = 600.0
FLEET_FLAP_SETTLE_S = 60.0
FLEET_LEASE_S = env_float("FLEET_LEASE_S", 15.0)
# Memory-aware loads (apps/fleet/memory.py), on nodes with a memory limit or GPUs: a load needs
# its footprint plus this share of it free; a footprint is measured from Triton's memory metrics
# this long after a load (one metrics interval, Triton's --metrics-interval-ms, and a margin),
# for its first FLEET_FOOTPRINT_SAMPLES loads; GPU readings Prometheus took longer ago than the
# age are not trusted.
FLEET_MEMORY_HEADROOM = env_float("FLEET_MEMORY_HEADROOM", 0.1)
FLEET_FOOTPRINT_SETTLE_S = env_float("FLEET_FOOTPRINT_SETTLE_S", 2.5)
FLEET_FOOTPRINT_SAMPLES = 3
FLEET_MEMORY_MAX_AGE_S = env_float("FLEET_MEMORY_MAX_AGE_S", 30.0)
TRITON_TIMEOUT_S = 5.0
# How long a load may take on a node; a running load is not taken over before it has passed.
FLEET_LOAD_TIMEOUT_S = env_float("FLEET_LOAD_TIMEOUT_S", 120.0)
# At most this share of a pool's nodes quarantined for hung loads (one at least): past it, a hang
# is the change's, not the node's, and the node keeps serving what it served.
FLEET_QUARANTINE_MAX_SHARE = env_float("FLEET_QUARANTINE_MAX_SHARE", 0.34)
PROMETHEUS_TIMEOUT_S = 5

# One JSON object per line, with the request id the audit trail records (controlplane.logs).
LOGGING = logging_config(env_str("LOG_LEVEL", "INFO"))
# Workers keep that logging instead of putting Celery's own plain handler on the root logger.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# /metrics answers without a token (a Prometheus on a private network); a token always works.
METRICS_ALLOW_ANONYMOUS = env_bool("METRICS_ALLOW_ANONYMOUS", False)

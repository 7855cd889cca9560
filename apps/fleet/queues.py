"""The queues the fleet's work is routed on, named once for the Celery app that routes them
(controlplane/celery.py) and for what watches them (apps/api/metrics.py).

The rollout controller's and the degradation automation's ticks and beat's heartbeat have a
queue of their own: on the default queue they would wait behind every node's task of a 500-node
release (and expire there), and a rollback or step-down decision would wait with them. Every
worker setup consumes it: the demo's and the tests' worker with `-Q celery,rollouts`,
production with a worker of its own (controlplane-worker@rollouts, the chart's worker-rollouts
Deployment)."""

ROLLOUTS_QUEUE = "rollouts"
ROLLOUT_TASKS = (
    "rollouts.advance_all",
    "rollouts.advance",
    "degradation.tick_all",
    "degradation.tick",
    "scaling.tick",
    "fleet.heartbeat",
)
# The Heartbeat row the last completed tick writes; /metrics reports its age.
TICK_HEARTBEAT = "rollouts"

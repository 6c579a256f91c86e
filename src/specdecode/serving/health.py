"""Whether a server's engine can still serve: read by ``GET /health`` and by Ray Serve's
replica health check (``serving/ray.py``), which restarts a replica that fails it.

A process can be up while its engine is not: the batch worker's thread may have died (every
batched request would then wait forever), or every step may fail (on a GPU, a device error
leaves the context unusable, so each later step fails too). Requests that fail one at a time
are the requests' fault, not the engine's, and do not count.
"""

from __future__ import annotations

from specdecode.serving.worker import BatchWorker

# Whole-batch step failures in a row that mark the engine broken: one or two can be a bad
# batch (the worker fails those requests and goes on); more with no good step between says
# nothing will succeed until the process restarts.
FAILED_STEPS_UNHEALTHY = 3


def engine_problem(worker: BatchWorker | None) -> str | None:
    """Why the engine behind ``worker`` cannot serve, or None when it can (or there is no worker)."""
    if worker is None:
        return None
    if not worker.alive:
        return "the batch engine's worker thread has stopped; restart the server"
    if worker.failed_steps_in_a_row >= FAILED_STEPS_UNHEALTHY:
        return (f"the batch engine's last {worker.failed_steps_in_a_row} steps failed as a whole; "
                "restart the server")
    return None

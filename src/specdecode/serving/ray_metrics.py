"""A replica's ``/metrics`` series, copied into Ray's metrics system for cluster-wide scraping.

``GET /metrics`` through Ray's proxy answers from whichever replica the router picks, so it shows
one replica at a time (its series carry a ``replica`` label). For every replica at once, each
replica also copies its series every ``EXPORT_PERIOD_SECONDS`` into Ray's metrics (Ray Serve's
``ray.serve.metrics``, which add the ``deployment``, ``replica`` and ``application`` tags); the
metrics agent on each Ray node exports them, named ``ray_specdecode_*``, on the node's Prometheus
endpoint (``ray start --metrics-export-port``), which is what a Prometheus scraping a Ray cluster
(or KubeRay's pod monitors) reads. Sum over replicas in PromQL, e.g.
``sum by (deployment) (rate(ray_specdecode_generated_tokens_total[1m]))``. Counters stay counters:
each copy adds what the counter gained since the last one.

The series come from the same text ``/metrics`` serves (``ServerMetrics.prometheus``), so a
metric added there is exported without a change here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from specdecode.serving.metrics import ServerMetrics

EXPORT_PERIOD_SECONDS = 2.0
# Ray Serve adds these tags itself; our own ``replica`` label would clash with its tag.
RAY_SERVE_TAGS = ("deployment", "replica", "application")

logger = logging.getLogger(__name__)


class RayMetricsExporter:
    """Copies ``metrics`` into Ray's metrics every ``period`` seconds from a daemon thread."""

    def __init__(self, metrics: ServerMetrics, period: float = EXPORT_PERIOD_SECONDS) -> None:
        self.metrics, self.period = metrics, period
        self._instruments: dict[str, Any] = {}
        self._last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # counter values already added
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specdecode-ray-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.period + 5)

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.export_once()
            except Exception:  # metrics must never take a replica down
                logger.warning("copying the metrics to Ray failed", exc_info=True)

    def export_once(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.metrics.prometheus()):
            for sample in family.samples:
                tags = {k: v for k, v in sample.labels.items() if k not in RAY_SERVE_TAGS}
                key = (sample.name, tuple(sorted(tags.items())))
                instrument = self._instrument(family.type, family.name, family.documentation, tuple(sorted(tags)))
                if family.type == "counter":
                    gained = sample.value - self._last.get(key, 0.0)
                    self._last[key] = sample.value
                    if gained > 0:
                        instrument.inc(gained, tags=tags)
                else:
                    instrument.set(sample.value, tags=tags)

    def _instrument(self, kind: str, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.serve import metrics

        instrument = self._instruments.get(name)
        if instrument is None:
            # A counter family is named without its "_total"; Ray's exporter adds it back.
            cls = metrics.Counter if kind == "counter" else metrics.Gauge
            instrument = cls(name, description=description or name, tag_keys=tag_keys)
            self._instruments[name] = instrument
        return instrument

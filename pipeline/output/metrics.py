"""Prometheus metrics for monitoring: ``--metrics-file PATH`` (text format, for node_exporter's textfile
collector: cron jobs with no server) and ``--metrics-port N`` (served over HTTP while the job runs).

Refreshed from the status snapshot at every flush and at the end, so they say what status.json says: rows by
state, output tokens/s, the ETA, the deadline's slack (time left minus the ETA; negative: at risk) and engine
restarts. The file is written to a temporary name and renamed, so the collector never reads half of it.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger("overnight")

ROW_STATES = ("total", "done", "ok", "error", "remaining", "in_flight", "aborted", "duplicates")
STATES = ("running", "completed", "partial", "interrupted", "failed")


class Metrics:
    def __init__(self, path: Optional[str], port: Optional[int], job: str):
        from prometheus_client import CollectorRegistry, Gauge

        self.path, self.job = path, job
        self.server = None  # --metrics-port's, until the job ends
        self.registry = r = CollectorRegistry()
        labels = ["job"]
        self.rows = Gauge("overnight_rows", "Input rows of the job by state", labels + ["state"], registry=r)
        self.tokens_per_s = Gauge("overnight_output_tokens_per_second", "Output tokens per second of this attempt",
                                  labels, registry=r)
        self.output_tokens = Gauge("overnight_output_tokens", "Output tokens in the job's output", labels, registry=r)
        self.eta = Gauge("overnight_eta_seconds", "Forecast seconds until the job is done (NaN: not known yet)",
                         labels, registry=r)
        self.slack = Gauge("overnight_deadline_slack_seconds", "Seconds left before the deadline minus the ETA; "
                                                               "negative when the deadline is at risk", labels,
                           registry=r)
        self.restarts = Gauge("overnight_engine_restarts", "Engine restarts in this attempt", labels, registry=r)
        self.state = Gauge("overnight_state", "1 for the job's current state", labels + ["state"], registry=r)
        self.exit_code = Gauge("overnight_exit_code", "The attempt's exit code (NaN while it runs)", labels,
                               registry=r)
        self.updated = Gauge("overnight_last_update_timestamp_seconds", "When these metrics were written",
                             labels, registry=r)
        if port:
            from prometheus_client import start_http_server

            try:
                self.server = start_http_server(port, registry=r)[0]
                log.info("serving Prometheus metrics on :%d/metrics", port)
            except OSError as e:  # a busy port: the job goes on without, as with a --metrics-file it cannot write
                log.warning(f"--metrics-port {port}: cannot serve metrics ({e.strerror or e}); the job goes on "
                            f"without them. Choose a free port.")

    def close(self) -> None:
        """Stop serving --metrics-port: the job has ended (its port is free for the next job in this process)."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def update(self, status: dict) -> None:
        nan = float("nan")
        job = self.job
        rows = status.get("rows", {})
        for s in ROW_STATES:
            if rows.get(s) is not None:
                self.rows.labels(job, s).set(rows[s])
        self.tokens_per_s.labels(job).set(status.get("output_tokens_per_s") or 0.0)
        self.output_tokens.labels(job).set(status.get("output_tokens") or 0)
        eta = status.get("eta_s")
        self.eta.labels(job).set(nan if eta is None else eta)
        # to the stop (the deadline less its safety margin), where the forecast's risk is judged; a Ray job's
        # status gives it beside the forecast it makes of its workers'
        left = (status.get("forecast") or {}).get("time_left_s", status.get("time_left_s"))
        self.slack.labels(job).set(nan if left is None or eta is None else left - eta)
        self.restarts.labels(job).set(status.get("engine_restarts") or 0)
        for s in STATES:
            self.state.labels(job, s).set(1 if status.get("state") == s else 0)
        code = status.get("exit_code")
        self.exit_code.labels(job).set(nan if code is None else code)
        self.updated.labels(job).set(time.time())
        if self.path:
            from prometheus_client import write_to_textfile

            try:
                write_to_textfile(self.path, self.registry)
            except OSError as e:  # monitoring must not fail the job
                log.warning("could not write the metrics file %s: %s", self.path, e)


class Published:
    """A job's status.json and, from the same snapshot, its metrics: a Ray job's driver writes the job's (its
    workers write none, so that each does not rewrite the one file, nor find the port taken)."""

    def __init__(self, out, output_cfg):
        self.out = out
        self.metrics = (Metrics(output_cfg.metrics_file, output_cfg.metrics_port, out.shown())
                        if output_cfg and (output_cfg.metrics_file or output_cfg.metrics_port) else None)

    def __call__(self, status: dict) -> None:
        self.out.write_status(status)
        if self.metrics is not None:
            self.metrics.update(status)

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

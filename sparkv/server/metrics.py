"""Prometheus metrics of one app instance (its own registry, so tests can run several apps).

Exposed at ``GET /metrics`` in the text format. Names and labels are listed in docs/server.md.
"""

from __future__ import annotations

from sparkv.extras import require

require("prometheus_client", feature="the server's metrics")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)
JOB_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class ServerMetrics:
    """Every metric the server exports."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sparkv_http_requests_total", "HTTP requests answered",
                                ["method", "route", "status"], registry=r)
        self.latency = Histogram("sparkv_http_request_duration_seconds",
                                 "Time from the request to the last byte of the response",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=r)
        self.response_bytes = Counter("sparkv_http_response_bytes_total",
                                      "Response body bytes sent", ["route"], registry=r)
        self.frames_served = Counter("sparkv_frames_served_total",
                                     "Frames sent (whole or partial)", ["endpoint", "level"],
                                     registry=r)
        self.frame_bytes = Counter("sparkv_frame_bytes_served_total", "Frame bytes sent",
                                   ["endpoint"], registry=r)
        self.streams_aborted = Counter("sparkv_streams_aborted_total",
                                       "Stream responses the client closed before the end",
                                       registry=r)
        self.stream_errors = Counter("sparkv_stream_errors_total",
                                     "Stream responses cut because a frame could not be read",
                                     registry=r)
        self.frames_corrupt = Counter("sparkv_frames_corrupt_total",
                                      "Stored frames not served because their size or checksum "
                                      "does not match the manifest", ["endpoint"], registry=r)
        self.streams_active = Gauge("sparkv_streams_active", "Stream responses in progress",
                                    registry=r)
        self.stream_buffered_bytes = Gauge(
            "sparkv_stream_buffered_bytes", "Frame bytes streams have read from the store and "
            "not yet handed to the HTTP server (at most about two batches per stream)",
            registry=r)
        self.streams_refused = Counter("sparkv_streams_refused_total",
                                       "Stream requests refused by a limit", ["reason"],
                                       registry=r)
        self.body_timeouts = Counter("sparkv_body_timeouts_total",
                                     "Requests answered 408 because their body did not arrive "
                                     "within body_timeout_s", registry=r)
        self.not_modified = Counter("sparkv_not_modified_total", "304 answers to If-None-Match",
                                    registry=r)
        self.auth_failures = Counter("sparkv_auth_failures_total", "Requests refused with 401",
                                     ["reason"], registry=r)
        self.jobs = Counter("sparkv_jobs_total", "Encode jobs by outcome (submitted, resumed, "
                            "done, failed, cancelled)", ["event"], registry=r)
        self.jobs_active = Gauge("sparkv_jobs_active", "Encode jobs queued or running",
                                 registry=r)
        self.job_seconds = Histogram("sparkv_job_duration_seconds", "Wall time of finished jobs",
                                     buckets=JOB_BUCKETS, registry=r)
        self.encode_frames = Counter("sparkv_encode_frames_total", "Frames encoded and stored",
                                     ["level"], registry=r)
        self.encode_tokens = Counter("sparkv_encode_tokens_total", "Context tokens prefilled",
                                     registry=r)
        self.encode_phase_seconds = Counter("sparkv_encode_phase_seconds_total",
                                            "Encode time by phase (prefill, codec, store)",
                                            ["phase"], registry=r)
        self.store_errors = Counter("sparkv_store_errors_total", "Store failures seen by requests",
                                    registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

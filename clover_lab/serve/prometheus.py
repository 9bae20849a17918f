"""The server's figures in Prometheus' format (``GET /metrics``), in a registry of its own per
server: requests, tokens, forwards and tokens per forward, queue length, rows running, the time
per forward, the time to the first committed token and per request."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("clover_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("clover_generated_tokens", "tokens generated", registry=r)
        self.forwards = Counter("clover_forwards", "model forwards after the prefills (one serves every row "
                                "that shares it)", registry=r)
        self.rows = Counter("clover_rows", "rows ended (a request's prompts and samples), by stop reason",
                            ["stop_reason"], registry=r)
        self.joined = Counter("clover_joined_rows", "rows that joined while other rows were running",
                              registry=r)
        self.tokens_per_forward = Gauge("clover_tokens_per_forward", "generated tokens per forward, over every "
                                        "row so far", registry=r)
        self.queue = Gauge("clover_queue_length", "prompts waiting to run", registry=r)
        self.running = Gauge("clover_running_rows", "rows running now", registry=r)
        self.forward_seconds = Histogram("clover_forward_seconds", "mean seconds per forward of a row (decode "
                                         "time over the forwards it took part in)", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.first_token = Histogram("clover_time_to_first_token_seconds", "request received to its first "
                                     "committed token", buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("clover_request_seconds", "request received to its last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self._totals = (0, 0)  # generated tokens, forwards: for tokens_per_forward

    def finished(self, result) -> None:
        """A row has ended: its GenerationResult's figures."""
        st = result.stats
        self.rows.labels(st.stop_reason).inc()
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generated_tokens.inc(st.new_tokens)
        self._totals = (self._totals[0] + st.new_tokens, self._totals[1])
        self._update()
        if st.forwards:
            self.forward_seconds.observe(st.decode_seconds / st.forwards)

    def stepped(self, forwards: int) -> None:
        """The engine ran ``forwards`` forwards (after the prefills) in a step."""
        if forwards:
            self.forwards.inc(forwards)
            self._totals = (self._totals[0], self._totals[1] + forwards)
            self._update()

    def _update(self) -> None:
        if self._totals[1]:
            self.tokens_per_forward.set(self._totals[0] / self._totals[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)

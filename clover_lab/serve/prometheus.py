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
        self.forwards = Counter("clover_forwards", "model forwards after the prefill (one serves every row "
                                "of a batch)", registry=r)
        self.batches = Counter("clover_batches", "batches run", registry=r)
        self.joined = Counter("clover_joined_rows", "rows that joined a running batch at a block boundary",
                              registry=r)
        self.tokens_per_forward = Gauge("clover_tokens_per_forward", "generated tokens per forward, over every "
                                        "batch so far", registry=r)
        self.queue = Gauge("clover_queue_length", "prompts waiting for a batch", registry=r)
        self.running = Gauge("clover_running_rows", "rows of the batch running now", registry=r)
        self.forward_seconds = Histogram("clover_forward_seconds", "mean seconds per forward of a batch (decode "
                                         "time over forwards)", buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("clover_time_to_first_token_seconds", "request received to its first "
                                     "committed token", buckets=LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("clover_request_seconds", "request received to its last token",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self._totals = (0, 0)  # generated tokens, forwards: for tokens_per_forward

    def batch(self, result) -> None:
        """A batch has ended: its BatchResult's figures."""
        st = result.stats
        self.batches.inc()
        self.prompt_tokens.inc(st.prompt_tokens)
        self.generated_tokens.inc(st.new_tokens)
        self.forwards.inc(st.forwards)
        self._totals = (self._totals[0] + st.new_tokens, self._totals[1] + st.forwards)
        if self._totals[1]:
            self.tokens_per_forward.set(self._totals[0] / self._totals[1])
        if st.forwards:
            self.forward_seconds.observe(st.decode_seconds / st.forwards)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The server's counters since start-up, rendered for /metrics in the Prometheus text format."""

from __future__ import annotations

import threading


class Metrics:
    """Counters since start-up, rendered in the Prometheus text format."""

    COUNTERS = {
        "requests": "Generation requests answered, by endpoint",
        "request_errors": "Requests refused or failed, by HTTP status",
        "queue_rejections": "Requests refused with 503 because the queue was full",
        "cancelled_requests": "Requests whose client went away before the answer was complete",
        "timed_out_requests": "Requests that ran past --request-timeout (answered 504 or an"
        " error event)",
        "cancelled_completion_tokens": "Tokens generated for requests cancelled while running",
        "prompt_tokens": "Prompt tokens of answered requests",
        "cached_prompt_tokens": "Prompt tokens whose cached rows were reused, not prefilled",
        "completion_tokens": "Tokens generated",
        "drafted_tokens": "Tokens proposed for verification (drafter and prompt lookup)",
        "accepted_tokens": "Proposed tokens the target accepted",
        "rounds": "Speculative rounds (one target forward each)",
        "prompt_seconds": "Time to the first token, summed",
        "generation_seconds": "Time from the first token to the last, summed",
        "prefix_cache_hits": "Requests that reused cached rows of a prefix (live or pooled)",
        "prefix_cache_misses": "Requests that prefilled their whole prompt",
        "prefix_cache_evictions": "Prefix pool entries dropped, least recently used first",
    }
    SUMMARIES = {
        "queue_wait_seconds": "Seconds a request waited in the queue before it started",
        "tokens_per_round": "A request's tokens per speculative round (accepted + 1 on average)",
        "batch_size": "Requests verified together in a batched round (--max-batch above 1)",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[tuple[str, tuple], float] = {}

    def add(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._values[key] = self._values.get(key, 0) + value

    def observe(self, name: str, value: float) -> None:
        """One observation of a summary: its sum and count grow."""
        self.add(f"{name}_sum", value)
        self.add(f"{name}_count")

    def record(self, endpoint: str, result) -> None:
        stats = result.stats
        self.add("requests", endpoint=endpoint)
        self.add("prompt_tokens", result.prompt_tokens)
        self.add("cached_prompt_tokens", stats.cached_tokens)
        self.add("completion_tokens", len(result.tokens))
        self.add("drafted_tokens", sum(stats.drafted))
        self.add("accepted_tokens", sum(stats.accepted))
        self.add("rounds", stats.rounds)
        self.add("prompt_seconds", result.prompt_seconds)
        self.add("generation_seconds", result.generation_seconds)
        if stats.rounds:
            self.observe("tokens_per_round", stats.tokens_per_round)

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        with self._lock:
            values = dict(self._values)
        lines = []
        for name, help_text in self.COUNTERS.items():
            lines += [
                f"# HELP woodcock_{name}_total {help_text}.",
                f"# TYPE woodcock_{name}_total counter",
            ]
            samples = [(labels, v) for (n, labels), v in values.items() if n == name] or [((), 0)]
            for labels, value in sorted(samples):
                label_text = ",".join(f'{k}="{v}"' for k, v in labels)
                lines.append(
                    f"woodcock_{name}_total{{{label_text}}} {_number(value)}"
                    if label_text
                    else f"woodcock_{name}_total {_number(value)}"
                )
        for name, help_text in self.SUMMARIES.items():
            lines += [f"# HELP woodcock_{name} {help_text}.", f"# TYPE woodcock_{name} summary"]
            for part in ("sum", "count"):
                value = values.get((f"{name}_{part}", ()), 0)
                lines.append(f"woodcock_{name}_{part} {_number(value)}")
        for name, (help_text, value) in gauges.items():
            lines += [f"# HELP woodcock_{name} {help_text}.", f"# TYPE woodcock_{name} gauge"]
            lines.append(f"woodcock_{name} {_number(value)}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A sample's value: whole numbers in full (bytes, token counts), others as %g."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"

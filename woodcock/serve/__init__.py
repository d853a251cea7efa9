"""`woodcock serve`: an OpenAI-compatible HTTP server that generates with speculative decoding.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
`stream: true`), GET /v1/models, /health and /metrics (Prometheus text). Every answer's `usage`
adds the speculative loop's statistics to OpenAI's token counts.

A request is parsed and checked (`request`) before it is queued; one worker thread owns the
model and runs the queued jobs in arrival order (`worker`) on the engine, which keeps a prompt
cache across requests (`engine`). `openai` shapes the answers, `metrics` counts them, `app`
routes HTTP requests to all of these, and `server` opens the pair and listens.
"""

from woodcock.serve.server import serve

__all__ = ["serve"]

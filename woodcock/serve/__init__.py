"""`woodcock serve`: an OpenAI-compatible HTTP server that generates with speculative decoding.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
`stream: true`), Anthropic's POST /v1/messages and /v1/messages/count_tokens, GET /v1/models,
/health and /metrics (Prometheus text). Every answer's `usage` adds the speculative loop's
statistics to the API's token counts.

A request is parsed and checked (`request`) before it is queued; one worker thread owns the
model and runs the queued jobs in arrival order (`worker`) on the engine, which reuses the KV
caches of recent conversations (`engine`, over the bounded pool of `prefix`). `openai` and
`anthropic` shape the answers, `metrics` counts them, `app` routes HTTP requests to all of these
(and answers those past their timeout), and `server` opens the pair and listens.
"""

from woodcock.serve.server import serve

__all__ = ["serve"]

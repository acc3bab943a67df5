"""Inference metrics besides vLLM's own (``vllm:*``, exported from the same registry)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SERVING_VERSION = Gauge("etude_inference_serving_version", "Policy version being served.")
UPDATE_PAUSE = Histogram(
    "etude_inference_update_pause_seconds",
    "Generation paused for one in-flight weight update.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
UPDATE_LAG = Histogram(
    "etude_inference_update_lag_seconds",
    "From a version's manifest being written to this replica serving it.",
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900),
)
UPDATE_FAILURES = Counter(
    "etude_inference_update_failures", "Versions this replica failed to load.", ["reason"]
)
# The errors a load may raise (services/inference/updates.py), present from the start so
# that increase() sees the first failure too.
for _reason in ("WeightsError", "CodecError", "ObjectStoreError"):
    UPDATE_FAILURES.labels(_reason)
GENERATED_TOKENS = Counter("etude_inference_generated_tokens", "Tokens generated.")
REQUESTS_RUNNING = Gauge("etude_inference_requests_in_flight", "Generate calls in progress.")
CAPTURE_ON = Gauge("etude_inference_routed_experts_capture", "1 when routed-expert capture is on.")
ROUTED_EXPERTS_BYTES = Counter(
    "etude_inference_routed_experts_bytes", "Routed-expert bytes sent in Generate answers."
)
PROMPT_TOKENS_CACHED = Counter(
    "etude_inference_prompt_tokens_cached", "Prompt tokens served from the prefix cache."
)

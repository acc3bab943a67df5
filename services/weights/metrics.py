"""Weight-exchange metrics (trainer side: publish; inference side: load)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)

# `kind` is "keyframe" or "delta": stored / raw of the deltas is what delta encoding saves.
BYTES_UPLOADED = Counter(
    "etude_weights_uploaded_bytes", "Bytes of weight objects uploaded, by kind.", ["kind"]
)
BYTES_DOWNLOADED = Counter("etude_weights_downloaded_bytes", "Bytes of weight objects downloaded.")
RAW_BYTES = Counter(
    "etude_weights_raw_bytes", "Uncompressed bytes of the tensors published, by kind.", ["kind"]
)
# Both kinds present from the start, so that rate() sees the first publish of each too.
for _kind in ("keyframe", "delta"):
    BYTES_UPLOADED.labels(_kind)
    RAW_BYTES.labels(_kind)
COMPRESSION_RATIO = Gauge(
    "etude_weights_compression_ratio", "Stored bytes / raw bytes of the last version published."
)
ENCODE_SECONDS = Histogram(
    "etude_weights_encode_seconds", "Encoding one shard of a version.", buckets=_SECONDS
)
DECODE_SECONDS = Histogram(
    "etude_weights_decode_seconds", "Reconstructing one version.", buckets=_SECONDS
)
UPLOAD_SECONDS = Histogram(
    "etude_weights_upload_seconds", "Uploading one shard of a version.", buckets=_SECONDS
)
PUBLISH_LAG = Histogram(
    "etude_weights_publish_lag_seconds",
    "From the snapshot of a version to its manifest and latest pointer being written.",
    buckets=_SECONDS,
)
PUBLISHED_VERSION = Gauge(
    "etude_weights_published_version", "Newest version this process published."
)
PUBLISH_FAILURES = Counter("etude_weights_publish_failures", "Versions given up after all tries.")
LOADED_VERSION = Gauge("etude_weights_loaded_version", "Newest version this process loaded.")
FALLBACKS = Counter(
    "etude_weights_keyframe_fallbacks",
    "Loads that fell back from the cached weights to a keyframe chain, by reason.",
    ["reason"],
)
# Every reason services/weights/subscriber.py gives, present from the start.
FALLBACK_REASONS = (
    "hash_mismatch",
    "crc_mismatch",
    "missing_base",
    "missing_object",
    "decode_error",
)
for _reason in FALLBACK_REASONS:
    FALLBACKS.labels(_reason)

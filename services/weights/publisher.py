"""Trainer side: publish versions of the policy without blocking training.

Each trainer rank owns a shard of the state dict. ``publish`` copies the shard (so the
optimizer can step on) and hands it to a background thread that encodes it against
the last version it knows is complete, uploads one object per tensor group in
parallel, and writes its shard part. Shard 0 then waits for every shard part, writes
the manifest (last: now the version exists) and moves ``latest``. A version that
cannot be completed after its tries is never referenced by ``latest``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import zlib
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from services.config import WeightsConfig
from services.model_source import Fingerprint
from services.objectstore.base import ObjectStore, ObjectStoreError
from services.weights import codec, metrics
from services.weights.manifest import (
    Layout,
    Manifest,
    ObjectEntry,
    ShardPart,
    TensorEntry,
    WeightsError,
    read_latest,
)
from services.weights.retention import collect_garbage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishResult:
    """What one shard published for a version."""

    version: int
    keyframe: bool
    raw_bytes: int
    stored_bytes: int
    encode_s: float
    upload_s: float
    manifest_written: bool


@dataclass
class _Job:
    version: int
    tensors: dict[str, torch.Tensor]
    keyframe: bool
    snapshot_at: float
    future: Future[PublishResult]


@dataclass
class _Published:
    version: int
    bits: dict[str, np.ndarray]


def _groups(names: list[str], tensors: Mapping[str, torch.Tensor], target: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if groups[-1] and size + nbytes > target:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


class WeightPublisher:
    """Publishes one shard's versions from a background thread."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        config: WeightsConfig,
        *,
        shard: int = 0,
        num_shards: int = 1,
        model: Fingerprint | None = None,
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is outside [0, num_shards={num_shards})")
        self.store = store
        self.layout = Layout(run)
        self.config = config
        self.shard = shard
        self.num_shards = num_shards
        self.model = model  # recorded in every manifest: replicas of another model refuse it
        # At most one version waits while one is encoded and uploaded: publish() blocks
        # beyond that, which is the backpressure training feels if uploads fall behind.
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._confirmed: _Published | None = None  # newest version whose manifest exists
        self._candidate: _Published | None = None  # uploaded by this shard, manifest unseen
        self._last_keyframe: int | None = None
        self._last_version = -1
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="weights-upload")
        self._thread = threading.Thread(
            target=self._work, name=f"weights-publisher-{shard}", daemon=True
        )
        self._thread.start()

    def publish(
        self, tensors: Mapping[str, torch.Tensor], version: int, *, keyframe: bool = False
    ) -> Future[PublishResult]:
        """Snapshots `tensors` now and publishes them as `version` in the background."""
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than {self._last_version}")
        for name, tensor in tensors.items():
            codec.dtype_name(tensor.dtype)  # TypeError for unsupported dtypes, before copying
            if not name:
                raise ValueError("tensor names must not be empty")
        snapshot = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        self._last_version = version
        job = _Job(version, snapshot, keyframe, time.time(), Future())
        self._jobs.put(job)
        return job.future

    def close(self, timeout_s: float | None = None) -> None:
        """Finishes the queued versions and stops the thread."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        self._pool.shutdown(wait=True)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            last_error: Exception | None = None
            for attempt in range(1, self.config.publish_attempts + 1):
                try:
                    job.future.set_result(self._publish(job))
                    break
                except (ObjectStoreError, WeightsError, OSError) as error:
                    last_error = error
                    log.warning(
                        "version %d shard %d, try %d: %s", job.version, self.shard, attempt, error
                    )
                except Exception as error:  # not worth a retry; the caller hears of it
                    log.exception("version %d shard %d not published", job.version, self.shard)
                    metrics.PUBLISH_FAILURES.inc()
                    job.future.set_exception(error)
                    break
            else:
                metrics.PUBLISH_FAILURES.inc()
                job.future.set_exception(
                    WeightsError(
                        f"version {job.version} shard {self.shard} not published: {last_error}"
                    )
                )

    def _base(self) -> _Published | None:
        candidate = self._candidate
        if candidate is not None and self.store.exists(self.layout.manifest(candidate.version)):
            self._confirmed, self._candidate = candidate, None
        return self._confirmed

    def _publish(self, job: _Job) -> PublishResult:
        base = self._base()
        keyframe = (
            job.keyframe
            or base is None
            or self._last_keyframe is None
            or job.version - self._last_keyframe >= self.config.keyframe_interval
        )
        started = time.perf_counter()
        names = sorted(job.tensors)
        bits = {name: codec.to_bits(job.tensors[name]) for name in names}
        objects: list[tuple[str, list[bytes]]] = []
        entries: list[TensorEntry] = []
        raw_bytes = 0
        for group, members in enumerate(_groups(names, job.tensors, self.config.group_bytes)):
            key = self.layout.object(job.version, self.shard, group)
            payloads: list[bytes] = []
            offset = 0
            for name in members:
                tensor, word_bits = job.tensors[name], bits[name]
                base_bits = None if keyframe or base is None else base.bits.get(name)
                if base_bits is not None and base_bits.shape != word_bits.shape:
                    base_bits = None  # reshaped or re-typed tensor: send it whole
                if base_bits is not None and base_bits.dtype != word_bits.dtype:
                    base_bits = None
                encoding, payload = codec.encode(word_bits, base_bits, self.config.zstd_level)
                entries.append(
                    TensorEntry(
                        name=name,
                        dtype=codec.dtype_name(tensor.dtype),
                        shape=tuple(tensor.shape),
                        object=key,
                        offset=offset,
                        length=len(payload),
                        encoding=encoding,
                        base_version=None if base_bits is None or base is None else base.version,
                        crc32=zlib.crc32(word_bits.data),
                    )
                )
                payloads.append(payload)
                offset += len(payload)
                raw_bytes += word_bits.nbytes
            objects.append((key, payloads))
        encode_s = time.perf_counter() - started
        metrics.ENCODE_SECONDS.observe(encode_s)

        started = time.perf_counter()
        infos = list(
            self._pool.map(lambda item: self.store.put(item[0], b"".join(item[1])), objects)
        )
        part = ShardPart(
            shard=self.shard,
            objects=[
                ObjectEntry(key=i.key, size=i.size, sha256=i.sha256, shard=self.shard)
                for i in infos
            ],
            tensors=entries,
            raw_bytes=raw_bytes,
        )
        self.store.put(
            self.layout.shard_part(job.version, self.shard), part.model_dump_json().encode()
        )
        upload_s = time.perf_counter() - started
        stored = sum(i.size for i in infos)
        metrics.UPLOAD_SECONDS.observe(upload_s)
        kind = "keyframe" if keyframe else "delta"
        metrics.BYTES_UPLOADED.labels(kind).inc(stored)
        metrics.RAW_BYTES.labels(kind).inc(raw_bytes)
        metrics.COMPRESSION_RATIO.set(stored / max(raw_bytes, 1))
        self._candidate = _Published(job.version, bits)  # views over the snapshot we own
        if keyframe:
            self._last_keyframe = job.version
        written = self.shard == 0 and self._write_manifest(job)
        return PublishResult(job.version, keyframe, raw_bytes, stored, encode_s, upload_s, written)

    def _write_manifest(self, job: _Job) -> bool:
        """Shard 0: once every shard part is in, writes the manifest, then `latest`."""
        deadline = time.monotonic() + self.config.shard_wait_s
        parts: list[ShardPart] = []
        for shard in range(self.num_shards):
            key = self.layout.shard_part(job.version, shard)
            while not self.store.exists(key):
                if time.monotonic() > deadline:
                    raise WeightsError(
                        f"version {job.version}: shard {shard} did not publish within "
                        f"{self.config.shard_wait_s:.0f} s ({key} missing); no manifest written"
                    )
                time.sleep(0.05)
            parts.append(ShardPart.model_validate_json(self.store.get(key)))
        tensors = [t for part in parts for t in part.tensors]
        if len({t.name for t in tensors}) != len(tensors):
            raise WeightsError(f"version {job.version}: two shards published the same tensor name")
        manifest = Manifest(
            run=self.layout.run,
            version=job.version,
            keyframe=all(t.encoding == "raw" for t in tensors),
            num_shards=self.num_shards,
            created_at=time.time(),
            raw_bytes=sum(p.raw_bytes for p in parts),
            stored_bytes=sum(o.size for p in parts for o in p.objects),
            objects=[o for part in parts for o in part.objects],
            tensors=tensors,
            model=self.model.to_dict() if self.model is not None else None,
        )
        self.store.put(self.layout.manifest(job.version), manifest.model_dump_json().encode())
        latest = read_latest(self.store, self.layout)
        if latest is None or job.version > latest:
            self.store.put(self.layout.latest, json.dumps({"version": job.version}).encode())
        metrics.PUBLISH_LAG.observe(time.time() - job.snapshot_at)
        metrics.PUBLISHED_VERSION.set(job.version)
        if self.config.collect_garbage:
            try:
                collect_garbage(self.store, self.layout.run, self.config.keep_last)
            except (ObjectStoreError, WeightsError) as error:  # the version is out; retry next time
                log.warning("retention after version %d failed: %s", job.version, error)
        return True

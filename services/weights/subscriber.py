"""Inference side: reconstruct published versions, bit-exactly, from the object store.

``WeightSubscriber.load(v)`` walks v's manifest and the manifests its deltas apply to
down to raw tensors or to the version it already holds, downloads the objects in
parallel, checks every object's size and SHA-256, decodes in version order and checks
every tensor's CRC-32. If that path fails (a damaged cache, a missing base), it tries
again from the keyframes alone and says so in a metric and a log line. A version whose
own objects are damaged or missing is never loaded: the error names the object.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import zlib
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from services.config import WeightsConfig
from services.model_source import Fingerprint
from services.objectstore.base import ObjectNotFound, ObjectStore, ObjectStoreError
from services.weights import codec, metrics
from services.weights.manifest import Layout, Manifest, WeightsError, read_latest, read_manifest

log = logging.getLogger(__name__)

State = dict[str, np.ndarray]


class WeightSubscriber:
    """Holds the newest loaded version and turns later versions into full tensors."""

    def __init__(
        self,
        store: ObjectStore,
        run: str,
        config: WeightsConfig,
        model: Fingerprint | None = None,
    ) -> None:
        self.store = store
        self.layout = Layout(run)
        self.config = config
        self.model = model  # a version trained from another model is refused (ModelMismatch)
        self.version: int | None = None
        self._state: State = {}
        self._shapes: dict[str, tuple[str, tuple[int, ...]]] = {}

    def latest(self) -> int | None:
        """The newest complete version in the store."""
        return read_latest(self.store, self.layout)

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """Full tensors of `version` (read-only views over the subscriber's copy)."""
        started = time.perf_counter()
        try:
            state = self._reconstruct(version, use_cache=self.version is not None)
        except (WeightsError, codec.CodecError, ObjectStoreError) as error:
            if self.version is None:
                raise
            reason = _reason(error)
            metrics.FALLBACKS.labels(reason).inc()
            log.warning(
                "version %d from cached version %d failed (%s: %s); rebuilding from keyframes",
                version,
                self.version,
                reason,
                error,
            )
            state = self._reconstruct(version, use_cache=False)
        self.version, self._state = version, state
        metrics.DECODE_SECONDS.observe(time.perf_counter() - started)
        metrics.LOADED_VERSION.set(version)
        return {name: codec.from_bits(bits, *self._shapes[name]) for name, bits in state.items()}

    def _chain(self, target: int, use_cache: bool) -> dict[int, Manifest]:
        manifests: dict[int, Manifest] = {}
        pending = [target]
        while pending:
            version = pending.pop()
            if version in manifests or (use_cache and version == self.version):
                continue
            try:
                manifest = read_manifest(self.store, self.layout, version)
            except WeightsError as error:
                if version == target:
                    raise
                raise WeightsError(f"version {target} needs version {version}: {error}") from error
            if self.model is not None and manifest.model is not None:
                theirs = Fingerprint.from_dict(manifest.model)
                self.model.require_same(theirs, f"policy version {version}")
            manifests[version] = manifest
            pending.extend(manifest.base_versions)
        return manifests

    def _download(self, manifests: dict[int, Manifest]) -> dict[str, bytes]:
        entries = {o.key: o for m in manifests.values() for o in m.objects}

        def fetch(key: str) -> tuple[str, bytes]:
            entry = entries[key]
            try:
                data = self.store.get(key)
            except ObjectNotFound as error:
                raise WeightsError(f"object {key} is missing") from error
            if len(data) != entry.size:
                raise WeightsError(
                    f"object {key} has {len(data)} bytes, the manifest says {entry.size}"
                )
            if hashlib.sha256(data).hexdigest() != entry.sha256:
                raise WeightsError(f"object {key} does not match its SHA-256 in the manifest")
            return key, data

        with ThreadPoolExecutor(self.config.concurrency) as pool:
            blobs = dict(pool.map(fetch, sorted(entries)))
        metrics.BYTES_DOWNLOADED.inc(sum(len(b) for b in blobs.values()))
        return blobs

    def _reconstruct(self, target: int, use_cache: bool) -> State:
        manifests = self._chain(target, use_cache)
        blobs = self._download(manifests)
        states: dict[int, State] = {}
        if use_cache and self.version is not None:
            states[self.version] = self._state
        order = sorted(manifests)
        last_use = {
            v: max((w for w in order if v in manifests[w].base_versions), default=target)
            for v in [*states, *order]
        }
        for version in order:
            manifest = manifests[version]
            state: State = {}
            for entry in manifest.tensors:
                if entry.dtype not in codec.DTYPES:
                    raise WeightsError(
                        f"version {version} tensor {entry.name} in {entry.object}: "
                        f"unknown dtype {entry.dtype!r}"
                    )
                uint = codec.DTYPES[entry.dtype][1]
                count = int(np.prod(entry.shape, dtype=np.int64))
                base = None
                if entry.base_version is not None:
                    base_state = states.get(entry.base_version)
                    if base_state is None or entry.name not in base_state:
                        raise WeightsError(
                            f"version {version} tensor {entry.name}: base version "
                            f"{entry.base_version} is not available"
                        )
                    base = base_state[entry.name]
                payload = blobs[entry.object][entry.offset : entry.offset + entry.length]
                try:
                    bits = codec.decode(entry.encoding, payload, base, uint, count)
                except codec.CodecError as error:
                    raise WeightsError(
                        f"version {version} tensor {entry.name} in {entry.object}: {error}"
                    ) from error
                if zlib.crc32(bits.data) != entry.crc32:
                    raise WeightsError(
                        f"version {version} tensor {entry.name} in {entry.object}: decoded bits do "
                        f"not match the published CRC-32 (wrong base {entry.base_version}?)"
                    )
                state[entry.name] = bits
                self._shapes[entry.name] = (entry.dtype, entry.shape)
            states[version] = state
            for done in [v for v in states if last_use.get(v, target) <= version and v != target]:
                del states[done]
        return states[target]

    async def follow(
        self, notices: AsyncIterator[int] | None = None, *, after: int | None = None
    ) -> AsyncIterator[int]:
        """Yields each newer complete version: from `notices` when they come, and from
        polling `latest` every `poll_interval_s` in case a notice is lost."""
        last = after if after is not None else (self.version if self.version is not None else -1)
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def from_notices() -> None:
            assert notices is not None
            async for version in notices:
                queue.put_nowait(version)

        listener = asyncio.create_task(from_notices()) if notices is not None else None
        try:
            while True:
                try:
                    candidate: int | None = await asyncio.wait_for(
                        queue.get(), self.config.poll_interval_s
                    )
                except TimeoutError:
                    candidate = await asyncio.to_thread(self.latest)
                if candidate is not None and candidate > last:
                    last = candidate
                    yield candidate
        finally:
            if listener is not None:
                listener.cancel()


def _reason(error: Exception) -> str:
    text = str(error)
    if "SHA-256" in text:
        return "hash_mismatch"
    if "CRC-32" in text:
        return "crc_mismatch"
    if "not available" in text or "needs version" in text or "no manifest" in text:
        return "missing_base"
    if "missing" in text:
        return "missing_object"
    return "decode_error"

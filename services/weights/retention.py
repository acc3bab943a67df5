"""Deleting versions no replica can still need.

A replica catching up loads the newest version, which needs its delta chain down to
raw tensors. Retention keeps the newest full keyframe and everything after it, at
least `keep_last` versions, and every version those still depend on; older versions
and the debris of versions that never completed (objects without a manifest, left by
a crashed publisher) are deleted. Manifests go first, so a reader never finds a
manifest whose objects are gone.
"""

from __future__ import annotations

import logging

from services.objectstore.base import ObjectStore
from services.weights.manifest import Layout, list_versions, read_latest, read_manifest

log = logging.getLogger(__name__)


def collect_garbage(store: ObjectStore, run: str, keep_last: int) -> list[int]:
    """Deletes unneeded versions of `run`; returns the versions removed (complete or not)."""
    layout = Layout(run)
    latest = read_latest(store, layout)
    if latest is None:
        return []
    complete = [v for v in list_versions(store, layout) if v <= latest]
    manifests = {v: read_manifest(store, layout, v) for v in complete}
    keyframes = [v for v in complete if manifests[v].keyframe]
    oldest_kept = min(
        keyframes[-1] if keyframes else complete[0], complete[-min(keep_last, len(complete))]
    )
    needed = {v for v in complete if v >= oldest_kept}
    pending = list(needed)
    while pending:
        for base in manifests[pending.pop()].base_versions:
            if base not in needed:
                needed.add(base)
                pending.append(base)
    removed = []
    present = {_version_of(key, layout) for key in store.list(f"{layout.root}/v")} - {None}
    for version in sorted(v for v in present if v is not None and v < latest and v not in needed):
        keys = store.list(f"{layout.version_dir(version)}/")
        manifest_key = layout.manifest(version)
        store.delete([k for k in keys if k == manifest_key])
        store.delete([k for k in keys if k != manifest_key])
        removed.append(version)
    if removed:
        log.info("retention removed versions %s of %s (keeping %s..)", removed, run, min(needed))
    return removed


def _version_of(key: str, layout: Layout) -> int | None:
    prefix = f"{layout.root}/v"
    digits = key[len(prefix) :].split("/", 1)[0]
    return int(digits) if key.startswith(prefix) and digits.isdigit() else None

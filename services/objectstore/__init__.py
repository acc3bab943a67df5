"""The object store every service shares: weights, rollout records, reports.

One small interface (``ObjectStore``) with a ``file://`` backend (the embedded
default) and an ``s3://`` backend on boto3. ``open_store(config)`` picks one by URL.
Writes are atomic: a reader sees a whole object or none.
"""

from services.objectstore.base import ObjectInfo, ObjectNotFound, ObjectStore, ObjectStoreError
from services.objectstore.factory import open_store

__all__ = ["ObjectInfo", "ObjectNotFound", "ObjectStore", "ObjectStoreError", "open_store"]

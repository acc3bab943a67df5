"""Weight exchange: versions of the policy published as sharded, delta-compressed
objects through the object store, and loaded back bit-exactly.

``codec`` turns tensors into bytes (XOR against the previous version, then zstd),
``manifest`` describes a version, ``publisher`` writes versions from trainer ranks in
the background, ``subscriber`` reconstructs them on inference replicas, ``retention``
deletes versions nobody can still need.
"""

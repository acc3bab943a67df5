"""Version 0's scores kept across runs: a base model is scored once.

Every gain is measured from version 0, the base model, and version 0 is scored on more
tasks (and samples) than later versions so that its interval is narrow: the costliest
eval of a run, and the same eval in every run from the same base model. Scored again,
it only adds noise (two evals of one version 0 have differed by 6 points). So a fresh
score of version 0 is also kept under a key of everything that decides it, and a run
whose version 0 has that key takes the kept record instead of sampling again:

    eval-cache/base/<key>.json     the EvalRecord as scored (its run: the one that sampled)

The key is the SHA-256 of

* the base weights, from version 0's manifest: the model's fingerprint (architecture and
  tokenizer) and every tensor's name, dtype, shape and CRC-32 of its bits -- not the run
  name, the objects' layout or the trainer's sharding;
* the eval: suite, family, the bytes of every task scored, K and the pass@k list;
* the rollouts' settings in the shared config (``[envs]``: the harness's budgets and
  sampling, the reward parts, the sandbox's limits).

What it leaves out is the inference engine (backend, dtype, kernels): a store holds one
deployment's results, and a change of engine numerics is a reason to turn
``evals.reuse_base_scores`` off (or delete ``eval-cache/base/``). ``etude run --fresh``
forgets a run, not the kept scores; a rebuilt base model has other weights, so another key.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from services.api.v1 import common_pb2
from services.config.envs import EnvsConfig
from services.evals.record import EvalRecord
from services.evals.suites import Suite
from services.objectstore.base import ObjectNotFound, ObjectStore
from services.weights.manifest import Manifest

log = logging.getLogger(__name__)

PREFIX = "eval-cache/base/"
KEY_FORMAT = 1  # bump when what the key holds changes: older entries are then never found
# Sandbox settings that do not change what a command does (who runs it, and how it is
# isolated): left out, so a cluster's pod sandboxes and a laptop's bubblewrap agree.
_SANDBOX_NOT_SCORED = {"uid", "allow_unsafe_local", "backend"}


def rollout_settings(envs: EnvsConfig) -> dict[str, Any]:
    """The part of ``[envs]`` that decides what an eval's samples are and how they score."""
    return {
        "harness": envs.harness.model_dump(mode="json"),
        "rewards": envs.rewards.model_dump(mode="json"),
        "sandbox": envs.sandbox.model_dump(mode="json", exclude=_SANDBOX_NOT_SCORED),
    }


def weights_identity(manifest: Manifest) -> dict[str, Any]:
    """What makes version 0's weights these weights, whatever run or layout published them."""
    return {
        "model": manifest.model,
        "tensors": sorted((t.name, t.dtype, list(t.shape), t.crc32) for t in manifest.tensors),
    }


def base_score_key(
    *,
    manifest: Manifest,
    suite: str,
    family: str,
    tasks: Sequence[common_pb2.Task],
    num_samples: int,
    ks: Sequence[int],
    settings: dict[str, Any],
) -> str:
    """The key of version 0's score of `suite` (see the module docstring)."""
    described = {
        "format": KEY_FORMAT,
        "weights": weights_identity(manifest),
        "suite": suite,
        "family": family,
        "tasks": [
            hashlib.sha256(t.SerializeToString(deterministic=True)).hexdigest() for t in tasks
        ],
        "num_samples": num_samples,
        "pass_at_k": sorted(ks),
        "rollouts": settings,
    }
    text = json.dumps(described, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class BaseScores:
    """Version 0's kept records in the object store, and their keys (blocking calls)."""

    def __init__(self, store: ObjectStore, envs: EnvsConfig) -> None:
        self.store = store
        self.settings = rollout_settings(envs)

    def key(
        self,
        manifest: Manifest,
        suite: Suite,
        tasks: Sequence[common_pb2.Task],
        num_samples: int,
        ks: Sequence[int],
    ) -> str:
        """The key of version 0's score of `suite` on `tasks` x `num_samples`."""
        return base_score_key(
            manifest=manifest,
            suite=suite.name,
            family=suite.family,
            tasks=tasks,
            num_samples=num_samples,
            ks=ks,
            settings=self.settings,
        )

    def load(self, key: str) -> EvalRecord | None:
        """The kept record of `key`; None when there is none (or it is unreadable)."""
        try:
            data = self.store.get(PREFIX + key + ".json")
        except ObjectNotFound:
            return None
        try:
            return EvalRecord.model_validate_json(data)
        except ValidationError as error:  # kept by another release: sample again
            log.warning("kept base score %s is unreadable, scoring anew: %s", key, error)
            return None

    def save(self, key: str, record: EvalRecord) -> None:
        """Keeps `record` (a fresh score of version 0) under `key`."""
        self.store.put(PREFIX + key + ".json", record.model_dump_json(indent=2).encode())

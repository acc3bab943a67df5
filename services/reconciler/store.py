"""The reconciler's state in Redis: every transition is one Lua script (lua/*.lua).

Keys of a run live under ``etude:{<run>}`` (one hash tag, so a run is one Redis
Cluster slot). Slot ids are ``<group id>/<sample index>``; group ids are random,
so ids are never reused even when Redis loses its last second of writes.
"""

from __future__ import annotations

import hashlib
import random
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.reconciler import ReconcilerConfig
from services.wire.errors import FailedPrecondition, NotFound

KIND_NAMES: dict[int, str] = {
    common_pb2.SLOT_KIND_TRAIN: "TRAIN",
    common_pb2.SLOT_KIND_EVAL: "EVAL",
}
KIND_VALUES: dict[str, Any] = {name: value for value, name in KIND_NAMES.items()}
SLOT_STATES = ("PENDING", "LEASED", "COMPLETE", "DEAD")
GROUP_STATES = ("RUNNING", "READY", "CONSUMED", "COMMITTED", "DROPPED")
# A Redis outage: a fault callers retry (the service answers UNAVAILABLE), not a bug.
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_SCRIPTS = (
    "submit",
    "claim",
    "heartbeat",
    "complete",
    "fail",
    "reap",
    "pull",
    "commit",
    "return",
    "publish",
)


def run_prefix(run_name: str) -> str:
    """Key prefix of a run."""
    return f"etude:{{{run_name}}}"


def new_group_id() -> str:
    """16 random hex digits."""
    return secrets.token_hex(8)


def _translate(error: ResponseError) -> Exception:
    """Script errors ("LEASE_LOST ...", "NOT_FOUND ...", "PRECONDITION ...") as service errors."""
    kind, _, message = str(error).partition(" ")
    if kind == "NOT_FOUND":
        return NotFound(message)
    if kind in ("LEASE_LOST", "PRECONDITION"):
        return FailedPrecondition(
            f"{message}" if kind == "PRECONDITION" else f"lease lost: {message}"
        )
    return error


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class PullResult:
    """Groups handed to a consumer for one step."""

    groups: list[reconciler_pb2.Group]
    staleness: list[int]
    num_dropped: int
    num_requeued: int
    repeated: bool


class SlotStore:
    """Typed access to the reconciler scripts for one run."""

    def __init__(self, client: aioredis.Redis, run_name: str, config: ReconcilerConfig) -> None:
        self.redis = client
        self.prefix = run_prefix(run_name)
        self.config = config
        lua = resources.files("services.reconciler").joinpath("lua")
        prelude = lua.joinpath("prelude.lua").read_text()
        self._scripts: dict[str, tuple[str, str]] = {}  # name -> (SHA-1, source)
        for name in _SCRIPTS:
            source = prelude + lua.joinpath(f"{name}.lua").read_text()
            self._scripts[name] = (hashlib.sha1(source.encode()).hexdigest(), source)

    async def _run(self, name: str, *args: Any) -> Any:
        # EVALSHA straight away: every transition is one round trip, and the scripts are
        # loaded only when this Redis has not seen them (a fresh or restarted server).
        sha, source = self._scripts[name]
        try:
            try:
                return await self.redis.execute_command("EVALSHA", sha, 1, self.prefix, *args)
            except NoScriptError:
                await self.redis.script_load(source)
                return await self.redis.execute_command("EVALSHA", sha, 1, self.prefix, *args)
        except ResponseError as error:
            raise _translate(error) from error

    def key(self, *parts: str) -> str:
        """A key of this run."""
        return ":".join((self.prefix, *parts))

    async def write_settings(self) -> None:
        """Settings the scripts read from Redis (retention of finished eval groups)."""
        retention_ms = int(self.config.committed_retention_s * 1000)
        await self.redis.hset(self.key("settings"), "retention_ms", retention_ms)

    async def submit(
        self,
        specs: Sequence[reconciler_pb2.GroupSpec],
        cursor: tuple[str, int] | None = None,
    ) -> list[str]:
        """Creates the groups (idempotent per idempotency_key); optionally moves a feeder cursor."""
        args: list[Any] = [
            self.key("feeder", cursor[0], "cursor") if cursor else "",
            cursor[1] if cursor else 0,
        ]
        for spec in specs:
            need = self.config.min_complete_samples or spec.num_samples
            args += [
                new_group_id(),
                spec.idempotency_key,
                spec.task.SerializeToString(),
                KIND_NAMES[spec.kind],
                spec.num_samples,
                spec.priority,
                spec.min_policy_version,
                min(need, spec.num_samples),
            ]
        return [_text(g) for g in await self._run("submit", *args)]

    async def claim(
        self,
        worker_id: str,
        kinds: Iterable[int],
        max_slots: int,
        ttl_s: float,
    ) -> list[reconciler_pb2.ClaimedSlot]:
        """Leases up to `max_slots` slots of `kinds` (all kinds when empty)."""
        wanted = [KIND_NAMES[k] for k in kinds] or ["EVAL", "TRAIN"]
        order = [k for k in ("EVAL", "TRAIN") if k in wanted]
        if self.config.priority_mode == "weighted" and random.random() >= self.config.eval_share:
            order.reverse()
        tokens = [secrets.token_hex(12) for _ in range(max_slots)]
        rows = await self._run(
            "claim",
            worker_id,
            int(ttl_s * 1000),
            max_slots,
            self.config.max_leased_per_version,
            self.config.max_ready_groups,
            self.config.max_groups_per_version,
            ",".join(order),
            *tokens,
        )
        claimed = []
        for sid, token, attempt, ttl_ms, gid, index, task, kind, k, start in rows:
            claimed.append(
                reconciler_pb2.ClaimedSlot(
                    lease=reconciler_pb2.Lease(
                        slot_id=_text(sid),
                        group_id=_text(gid),
                        sample_index=int(index),
                        lease_token=_text(token),
                        ttl_s=int(ttl_ms) / 1000,
                        attempt=int(attempt),
                    ),
                    task=common_pb2.Task.FromString(task),
                    kind=KIND_VALUES[_text(kind)],
                    num_samples=int(k),
                    start_policy_version=int(start),
                )
            )
        return claimed

    async def heartbeat(self, slot_id: str, token: str) -> float:
        """Renews a lease for its TTL; FailedPrecondition when it was lost."""
        ((ttl_s, problem),) = await self.heartbeat_many([(slot_id, token)])
        if problem:
            raise _translate(ResponseError(problem))
        return ttl_s

    async def heartbeat_many(self, leases: Sequence[tuple[str, str]]) -> list[tuple[float, str]]:
        """Renews (slot id, token) leases in one script; per lease, (TTL in s, "") when
        renewed or (0, the problem: "NOT_FOUND ..." / "LEASE_LOST ...") when not."""
        flat = await self._run("heartbeat", *(part for lease in leases for part in lease))
        return [(int(flat[i]) / 1000, _text(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def complete(
        self, slot_id: str, token: str, rollout: common_pb2.RolloutSummary
    ) -> tuple[str, bool]:
        """Completes a slot; returns (group state, duplicate)."""
        state, duplicate = await self._run(
            "complete", slot_id, token, rollout.SerializeToString(), rollout.rollout_id
        )
        return _text(state), bool(int(duplicate))

    async def fail(self, slot_id: str, token: str, reason: str, retryable: bool) -> tuple[str, int]:
        """Records a failed attempt; returns (slot state, attempts so far)."""
        state, attempts = await self._run(
            "fail", slot_id, token, reason, int(retryable), self.config.max_attempts
        )
        return _text(state), int(attempts)

    async def reap(self, batch: int = 1000) -> int:
        """Returns expired leases to pending (or dead); the number looked at."""
        return int(await self._run("reap", self.config.max_attempts, batch))

    async def pull(
        self, consumer: str, step: int, num_groups: int, current_version: int, partial: bool
    ) -> PullResult:
        """Moves ready groups to consumed for (consumer, step), applying the staleness policy."""
        config = self.config
        gids, staleness, dropped, requeued, repeated = await self._run(
            "pull",
            consumer,
            step,
            num_groups,
            current_version,
            config.max_staleness,
            config.stale_policy,
            config.stale_decay,
            config.staleness_anchor,
            int(partial),
        )
        groups = [await self.get_group(_text(g)) for g in gids]
        return PullResult(
            groups, [int(s) for s in staleness], int(dropped), int(requeued), bool(repeated)
        )

    async def commit(self, consumer: str, step: int, group_ids: Sequence[str] = ()) -> int:
        """Marks everything `consumer` pulled for steps <= `step`, and `group_ids`, as trained."""
        retention_ms = int(self.config.committed_retention_s * 1000)
        return int(await self._run("commit", consumer, step, retention_ms, *group_ids))

    async def return_slots(
        self, consumer: str, step: int, slots: Sequence[reconciler_pb2.ReturnedSlot]
    ) -> list[str]:
        """Hands back the groups of `slots` that `consumer` pulled for `step`, each named
        slot run again (retryable) or dead; per slot its new state, "" when unchanged."""
        args: list[Any] = [consumer, step, self.config.max_attempts]
        for slot in slots:
            args += [slot.slot_id, slot.reason, int(slot.retryable)]
        return [_text(state) for state in await self._run("return", *args)]

    async def get_group(self, group_id: str) -> reconciler_pb2.Group:
        """The group with its slots and completed rollouts; NotFound when unknown."""
        raw: dict[Any, Any] = await self.redis.hgetall(self.key("group", group_id))
        fields = {_text(k): v for k, v in raw.items()}
        if not fields:
            raise NotFound(f"group {group_id} does not exist (or its retention ended)")
        k = int(fields["k"])
        async with self.redis.pipeline(transaction=False) as pipe:
            for index in range(k):
                pipe.hgetall(self.key("slot", f"{group_id}/{index}"))
            slot_rows = await pipe.execute()
        group = reconciler_pb2.Group(
            group_id=group_id,
            task=common_pb2.Task.FromString(fields["task"]),
            kind=KIND_VALUES[_text(fields["kind"])],
            num_samples=k,
            state=reconciler_pb2.GroupState.Value(f"GROUP_STATE_{_text(fields['state'])}"),
            start_policy_version=max(int(fields["start_version"]), 0),
            created_at=int(fields["created_at"]) / 1000,
            ready_at=int(fields.get("ready_at", 0)) / 1000,
            weight=float(fields.get("weight", 1)),
            staleness=int(fields.get("staleness", 0)),
        )
        for index, raw in enumerate(slot_rows):
            slot = {_text(key): value for key, value in raw.items()}
            group.slots.append(
                reconciler_pb2.SlotInfo(
                    slot_id=f"{group_id}/{index}",
                    sample_index=index,
                    state=reconciler_pb2.SlotState.Value(f"SLOT_STATE_{_text(slot.get('state'))}"),
                    attempts=int(slot.get("attempts", 0)),
                    last_failure=_text(slot.get("last_failure")),
                )
            )
            if "rollout" in slot:
                group.rollouts.append(common_pb2.RolloutSummary.FromString(slot["rollout"]))
        return group

    async def group_states(self, group_ids: Sequence[str]) -> dict[str, str]:
        """State name of each group ("" for unknown ids)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for gid in group_ids:
                pipe.hget(self.key("group", gid), "state")
            states = await pipe.execute()
        return {gid: _text(state) for gid, state in zip(group_ids, states, strict=True)}

    async def counts(self) -> dict[str, int]:
        """Slots and groups by state, and event counters (lease expiries, rejections, ...)."""
        raw = await self.redis.hgetall(self.key("counts"))
        return {_text(k): int(v) for k, v in raw.items()}

    async def dead_reasons(self) -> dict[str, int]:
        """Dead slots by the reason of their last failure."""
        raw = await self.redis.hgetall(self.key("dead_reasons"))
        return {_text(k): int(v) for k, v in raw.items()}

    async def current_version(self) -> int:
        """The newest published policy version (0 before any)."""
        return int(await self.redis.get(self.key("version")) or 0)

    async def publish_version(self, notice: common_pb2.PolicyVersionNotice) -> int:
        """Records a published version (monotonic) and notifies followers."""
        return int(
            await self._run("publish", notice.version, notice.manifest_key, int(notice.keyframe))
        )

    async def version_notices(
        self, after_version: int, last_id: str = "0", block_ms: int = 0
    ) -> tuple[list[common_pb2.PolicyVersionNotice], str]:
        """Notices of versions newer than `after_version` from the stream after `last_id`."""
        entries: Any
        if block_ms:
            answer: Any = await self.redis.xread({self.key("versions"): last_id}, block=block_ms)
            entries = answer[0][1] if answer else []
        else:
            entries = await self.redis.xrange(
                self.key("versions"), min=f"({last_id}" if last_id != "0" else "-"
            )
        notices = []
        for entry_id, raw in entries:
            last_id = _text(entry_id)
            fields = {_text(k): _text(v) for k, v in raw.items()}
            version = int(fields["version"])
            if version > after_version:
                notices.append(
                    common_pb2.PolicyVersionNotice(
                        version=version,
                        manifest_key=fields["manifest_key"],
                        keyframe=fields["keyframe"] == "1",
                        published_at=float(fields["published_at"]),
                    )
                )
        return notices, last_id

"""Task sources that keep a target number of groups in flight.

A feeder addresses tasks by position; the reconciler stores the last submitted
position (the cursor) in Redis in the same atomic step that creates the groups,
and every group carries the idempotency key ``feeder:<name>:<position>``. So a
restart resumes where it stopped, and a task is never submitted twice: training
is single-epoch by default.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import logging
from collections.abc import Callable

from google.protobuf import json_format
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.api.v1 import common_pb2, reconciler_pb2
from services.config.reconciler import FeederConfig
from services.messages import validate_task
from services.objectstore import ObjectStore
from services.reconciler.store import SlotStore

log = logging.getLogger(__name__)


class TaskFeeder(abc.ABC):
    """A deterministic sequence of tasks."""

    @abc.abstractmethod
    def tasks_from(self, position: int, count: int) -> list[common_pb2.Task]:
        """Up to `count` tasks starting at `position`; fewer (or none) when the source ends."""


class JsonlTaskFeeder(TaskFeeder):
    """Tasks from a file of protobuf-JSON Task messages, one per line: a local file
    (``path``) or an object in the store (``key``), read once, whole, when built."""

    def __init__(self, config: FeederConfig, store: ObjectStore | None = None) -> None:
        if config.key is not None:
            if store is None:
                raise ValueError(f"feeder key {config.key!r}: no object store to read it from")
            source, text = f"object {config.key}", store.get(config.key).decode()
        else:
            assert config.path is not None  # the config validator guarantees one of them
            source, text = str(config.path), config.path.read_text()
        self.tasks = parse_tasks(text, source)

    def tasks_from(self, position: int, count: int) -> list[common_pb2.Task]:
        return self.tasks[position : position + count]


def parse_tasks(text: str, source: str) -> list[common_pb2.Task]:
    """Every Task of a JSON-lines text (blank lines skipped); a bad line names its number."""
    tasks = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = json_format.Parse(line, common_pb2.Task())
            validate_task(task, "task")
        except (json_format.ParseError, ValueError) as error:
            raise ValueError(f"{source}:{number}: not a valid Task: {error}") from error
        tasks.append(task)
    return tasks


Generator = Callable[[int, int], common_pb2.Task | None]


def load_generator(spec: str) -> Generator:
    """The function a ``module:function`` spec names."""
    module, _, name = spec.partition(":")
    function: Generator = getattr(importlib.import_module(module), name)
    return function


class GeneratorTaskFeeder(TaskFeeder):
    """Tasks made on demand by ``function(position, seed) -> Task | None`` (None ends it)."""

    def __init__(self, config: FeederConfig) -> None:
        assert config.generator is not None  # the config validator guarantees it
        self._make = load_generator(config.generator)
        self._seed = config.seed

    def tasks_from(self, position: int, count: int) -> list[common_pb2.Task]:
        tasks = []
        for index in range(position, position + count):
            task = self._make(index, self._seed)
            if task is None:
                break
            validate_task(task, f"generated task {index}")
            tasks.append(task)
        return tasks


def mix_schedule(weights: list[int]) -> list[tuple[int, int]]:
    """One cycle of a weighted mix: for each of its sum(weights) positions, the source and
    how many positions of that source came earlier in the cycle. Smooth weighted round
    robin: each source's positions are spread evenly over the cycle, never bunched."""
    total = sum(weights)
    credit = [0] * len(weights)
    taken = [0] * len(weights)
    cycle = []
    for _ in range(total):
        credit = [c + w for c, w in zip(credit, weights, strict=True)]
        source = max(range(len(weights)), key=lambda i: (credit[i], -i))
        credit[source] -= total
        cycle.append((source, taken[source]))
        taken[source] += 1
    return cycle


class MixTaskFeeder(TaskFeeder):
    """Several generators interleaved by weight: position p is source s's position
    ``(p // cycle) * weight_s + rank``, so each source's tasks come in its own order, none
    skipped or repeated, and a restart from a cursor resumes every source where it was.
    The feed ends at the first position whose source has ended (the shares hold to the
    end)."""

    def __init__(self, config: FeederConfig) -> None:
        self._makes = [load_generator(source.generator) for source in config.mix]
        self._weights = [source.weight for source in config.mix]
        self._cycle = mix_schedule(self._weights)
        self._seed = config.seed

    def source_of(self, position: int) -> tuple[int, int]:
        """The source of feed position `position`, and the position within that source."""
        cycles, offset = divmod(position, len(self._cycle))
        source, rank = self._cycle[offset]
        return source, cycles * self._weights[source] + rank

    def tasks_from(self, position: int, count: int) -> list[common_pb2.Task]:
        tasks = []
        for index in range(position, position + count):
            source, at = self.source_of(index)
            task = self._makes[source](at, self._seed)
            if task is None:
                break
            validate_task(task, f"mixed task {index} (source {source}, position {at})")
            tasks.append(task)
        return tasks


def build_feeder(config: FeederConfig, store: ObjectStore | None = None) -> TaskFeeder:
    """The feeder `config.kind` names (`store`: where a ``key`` is read from)."""
    if config.kind == "jsonl":
        return JsonlTaskFeeder(config, store)
    if config.kind == "mix":
        return MixTaskFeeder(config)
    return GeneratorTaskFeeder(config)


async def top_up(store: SlotStore, feeder: TaskFeeder, config: FeederConfig) -> int:
    """Submits groups until `target_in_flight` are submitted-but-unconsumed; returns how many."""
    counts = await store.counts()
    # Its own (training) groups only: eval groups stay READY until they expire.
    in_flight = counts.get("train_group:RUNNING", 0) + counts.get("train_group:READY", 0)
    wanted = config.target_in_flight - in_flight
    if wanted <= 0:
        return 0
    cursor = int(await store.redis.get(store.key("feeder", config.name, "cursor")) or -1)
    tasks = feeder.tasks_from(cursor + 1, wanted)
    if not tasks:
        return 0
    specs = [
        reconciler_pb2.GroupSpec(
            task=task,
            num_samples=config.num_samples,
            kind=common_pb2.SLOT_KIND_TRAIN,
            idempotency_key=f"feeder:{config.name}:{cursor + 1 + offset}",
        )
        for offset, task in enumerate(tasks)
    ]
    await store.submit(specs, cursor=(config.name, cursor + len(tasks)))
    return len(tasks)


async def run_feeder(
    store: SlotStore, feeder: TaskFeeder, config: FeederConfig, owner: str
) -> None:
    """Tops up every interval while this replica holds the feeder's lease in Redis."""
    lease_key = store.key("feeder", config.name, "leader")
    lease_ms = int(max(3 * config.interval_s, 1.0) * 1000)
    exhausted = False
    while True:
        try:
            leader = await store.redis.set(lease_key, owner, nx=True, px=lease_ms)
            if not leader and await store.redis.get(lease_key) == owner.encode():
                leader = await store.redis.pexpire(lease_key, lease_ms)
            if leader:
                submitted = await top_up(store, feeder, config)
                if submitted:
                    log.info("feeder %s submitted %d groups", config.name, submitted)
                    exhausted = False
                elif not exhausted:
                    exhausted = True
                    log.info(
                        "feeder %s: nothing to submit (in flight or source ended)", config.name
                    )
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            log.warning("feeder %s: redis unavailable (%s)", config.name, error)
        await asyncio.sleep(config.interval_s)

"""Reconciler metrics. State counts live in Redis (shared by every replica); each replica
exports the last snapshot it read, so dashboards aggregate with max(), not sum()."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.reconciler.store import GROUP_STATES, SLOT_STATES

GROUP_LATENCY = Histogram(
    "etude_reconciler_group_latency_seconds",
    "From a group's submission to the completion that made it ready.",
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
STALENESS = Histogram(
    "etude_reconciler_staleness_versions",
    "Policy versions between a group's start and the trainer step that pulled it.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)


# The dead-slot reasons of reap.lua and commit.lua.
OWN_DEAD_REASONS = ("lease expired", "withdrawn: group already trained")


class StateSnapshot(Collector):
    """Exports the latest counts read from Redis."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.dead_reasons: dict[str, int] = {}
        self.policy_version = 0

    def collect(self) -> Iterator[Metric]:
        counts = self.counts
        slots = GaugeMetricFamily("etude_reconciler_slots", "Slots by state.", labels=["state"])
        for state in SLOT_STATES:
            slots.add_metric([state], counts.get(f"slot:{state}", 0))
        groups = GaugeMetricFamily("etude_reconciler_groups", "Groups by state.", labels=["state"])
        for state in GROUP_STATES:
            groups.add_metric([state], counts.get(f"group:{state}", 0))
        training = GaugeMetricFamily(
            "etude_reconciler_training_groups",
            "Training groups by state (eval groups stay READY: their results are kept).",
            labels=["state"],
        )
        for state in GROUP_STATES:
            training.add_metric([state], counts.get(f"train_group:{state}", 0))
        expiries = CounterMetricFamily(
            "etude_reconciler_lease_expiries", "Leases that expired (worker lost)."
        )
        expiries.add_metric([], counts.get("lease_expiries", 0))
        rejected = CounterMetricFamily(
            "etude_reconciler_rejected_completions",
            "Completions, heartbeats and failures refused because the lease was lost.",
        )
        rejected.add_metric([], counts.get("rejected:lease_lost", 0))
        stale = CounterMetricFamily(
            "etude_reconciler_stale_groups", "Groups past max_staleness.", labels=["action"]
        )
        stale.add_metric(["dropped"], counts.get("stale_dropped", 0))
        stale.add_metric(["requeued"], counts.get("stale_requeued", 0))
        returned = CounterMetricFamily(
            "etude_reconciler_returned_slots",
            "Completed slots the trainer handed back (their record failed to load or check).",
            labels=["action"],
        )
        returned.add_metric(["requeued"], counts.get("returned_slots:requeued", 0))
        returned.add_metric(["dead"], counts.get("returned_slots:dead", 0))
        dead = CounterMetricFamily("etude_reconciler_dead_slots", "Dead slots.", labels=["reason"])
        # The reasons the reconciler's scripts write themselves are there from the start
        # (increase() then sees the first death); a FailSlot's reason is the worker's.
        reasons = dict.fromkeys(OWN_DEAD_REASONS, 0) | self.dead_reasons
        for reason, value in sorted(reasons.items()):
            dead.add_metric([reason], value)
        version = GaugeMetricFamily(
            "etude_reconciler_policy_version", "Newest published policy version."
        )
        version.add_metric([], self.policy_version)
        yield from (slots, groups, training, expiries, rejected, stale, returned, dead, version)


SNAPSHOT = StateSnapshot()
REGISTRY.register(SNAPSHOT)

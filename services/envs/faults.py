"""Whose fault a failed rollout is: the code's (it is scored) or the infrastructure's (it
is retried and never trained on).

The code's faults are scored like any result, usually 0: wrong output, an exception
(``syntax_error``, ``import_error``, ``no_result``, a crash of its own), its own infinite
loop (``timeout`` or the CPU limit). They are ``GradeResult.failure_reason`` values.

The infrastructure's faults are ``InfraKind`` values. Grading raises ``InfraFault`` for
those of the sandbox; the rollout worker fails the slot as retryable with the reason
``infra:<kind>: <detail>`` and counts it once in ``etude_envs_infra_faults_total{kind}``.
Every failed attempt of a slot is the infrastructure's (the code's faults complete their
slot with their score), so a slot's ``attempts - 1`` (``attempts`` if it died) are its
faults and its ``last_failure`` names the last one's kind.

A timeout is judged by CPU time, not wall time (``judge_first``, ``judge_rerun``): a run
that timed out having used less than 90 % of its limit as CPU is re-run once in a fresh
sandbox with the limit as its CPU-time limit (and ``JUDGE_WALL_FACTOR`` times it as wall
clock). The re-run's result counts if it finishes; reaching the CPU limit is the code's
loop; running out of wall time again is the host's fault if the program was starved (in
the last quarter of its wall clock its threads waited on the run queue longer than they
ran, and ran or waited at least half that time), and otherwise the code's: a program
that sleeps or blocks past its limit, in two sandboxes, scores 0. A sandbox that the
host could not even set up before the wall clock ran out is the host's too.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from grpc import aio

from services.envs.sandbox import ExecOutcome
from services.objectstore.base import ObjectStoreError
from services.slot_faults import INFRA_PREFIX, LEASE_EXPIRED, InfraKind, slot_faults

__all__ = ["INFRA_PREFIX", "LEASE_EXPIRED", "InfraFault", "InfraKind", "slot_faults"]

# A first run that used this share of its wall time as CPU was not starved: its timeout
# is its own, with no re-run.
UNSTARVED_CPU_SHARE = 0.9
# A run is starved when, in the watched end of its wall clock, its threads asked for a CPU
# (ran or waited on the run queue) at least this share of the time and waited longer than
# they ran.
STARVED_DEMAND_SHARE = 0.5


class InfraFault(RuntimeError):
    """A fault of the infrastructure: the attempt is retried, never scored."""

    def __init__(self, kind: InfraKind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Verdict(enum.Enum):
    """What a sandbox run's ending says about whose fault it is."""

    RAN = "ran"  # read its result: whatever it says is the code's
    CODE_LOOP = "code_loop"  # it used its whole CPU budget: the code's own loop
    RERUN = "rerun"  # timed out with CPU to spare: judge it again by CPU time
    CODE_STALLED = "code_stalled"  # timed out again, neither running nor starved


@dataclass(frozen=True)
class Judgement:
    """A verdict and the run it rests on (its figures go to logs and failure reasons)."""

    verdict: Verdict
    outcome: ExecOutcome

    def describe(self) -> str:
        run = self.outcome
        text = f"cpu {run.cpu_s:.2f} s in {run.wall_s:.2f} s"
        if run.tail_s:
            text += (
                f"; in its last {run.tail_s:.2f} s ran {run.tail_run_s:.2f} s and waited for "
                f"a CPU {run.tail_wait_s:.2f} s"
            )
        return text


def starved(outcome: ExecOutcome) -> bool:
    """Whether the run, as its wall clock ran out, wanted a CPU it did not get (a program
    sleeping or blocked neither runs nor waits on the run queue)."""
    demand = outcome.tail_run_s + outcome.tail_wait_s
    return (
        outcome.tail_wait_s > outcome.tail_run_s and demand >= STARVED_DEMAND_SHARE * outcome.tail_s
    )


def check_infra(outcome: ExecOutcome) -> None:
    """Raises InfraFault when the sandbox, not the code, ended the run."""
    if not outcome.started and outcome.timed_out:
        raise InfraFault(
            InfraKind.HOST_OVERLOADED,
            f"timed out before the sandbox was set up ({outcome.wall_s:.2f} s)",
        )
    if not outcome.started:
        detail = outcome.stderr.decode(errors="replace").strip()[-200:]
        raise InfraFault(InfraKind.SANDBOX_START, detail or "the sandbox did not start")
    if outcome.killed_outside:
        raise InfraFault(InfraKind.KILLED_OUTSIDE, f"{outcome.killed_by} from outside the sandbox")


def judge_first(outcome: ExecOutcome, limit_s: float) -> Judgement:
    """The verdict on a first run under a `limit_s` wall clock (raises InfraFault)."""
    check_infra(outcome)
    verdict = Verdict.RAN
    if outcome.timed_out:
        used_cpu = outcome.cpu_s >= UNSTARVED_CPU_SHARE * limit_s
        verdict = Verdict.CODE_LOOP if used_cpu else Verdict.RERUN
    return Judgement(verdict, outcome)


def judge_rerun(outcome: ExecOutcome, cpu_limit_s: float) -> Judgement:
    """The verdict on the re-run of a timeout under a `cpu_limit_s` CPU-time limit
    (raises InfraFault, HOST_OVERLOADED when it was starved again)."""
    check_infra(outcome)
    if outcome.cpu_s >= cpu_limit_s or outcome.killed_by == "rlimit_cpu":
        return Judgement(Verdict.CODE_LOOP, outcome)
    if not outcome.timed_out:
        return Judgement(Verdict.RAN, outcome)
    if starved(outcome):
        description = Judgement(Verdict.RAN, outcome).describe()
        raise InfraFault(
            InfraKind.HOST_OVERLOADED, f"timed out twice, starved of CPU: {description}"
        )
    return Judgement(Verdict.CODE_STALLED, outcome)


def infra_kind(error: BaseException) -> InfraKind:
    """The kind of infrastructure fault an exception of a rollout attempt is."""
    if isinstance(error, InfraFault):
        return error.kind
    if isinstance(error, aio.AioRpcError):
        return InfraKind.INFERENCE
    if isinstance(error, ObjectStoreError):
        return InfraKind.OBJECT_STORE
    return InfraKind.WORKER


def failure_reason(error: BaseException) -> str:
    """The FailSlot reason of an attempt that raised: ``infra:<kind>: <detail>``."""
    kind = infra_kind(error)
    detail = error.detail if isinstance(error, InfraFault) else f"{type(error).__name__}: {error}"
    return f"{INFRA_PREFIX}{kind}: {detail}"[:500]

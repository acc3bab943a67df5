"""How far off-policy an RL step trains: the version lag of its tokens, and the importance
ratio by lag.

A trained token's version lag is the policy version the step trains from (the trainer's
weights before the step's update) minus the version that generated the token, which the
rollout's version spans record per token (``rollouts.parse_segment``). A rollout that spans
a weight update has tokens of several lags. The importance ratio is
``pi_train / pi_behaviour = exp(log pi_theta - log pi_behaviour)`` before truncation: by
lag it separates the drift of stale tokens (lag > 0) from the train/inference numerical
mismatch alone (lag 0).

Lags fall in ``metrics.LAG_BUCKETS`` (0, 1, 2, 3+). A trained token no span covers (a
record written without spans), or one whose version is newer than the trainer's (which
only a wrong record can hold), has an unknown lag: it is counted apart and left out of
the lag figures.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from services.trainer.metrics import LAG_BUCKETS

LAG_SUM_NAMES = (
    *(f"tokens_lag{bucket}" for bucket in LAG_BUCKETS),
    *(f"ratio_lag{bucket}" for bucket in LAG_BUCKETS),
    "tokens_lag_unknown",
    "lag",
)
"""The per-microbatch sums ``lag_sums`` returns, in one order on every rank."""


def known_lags(generating_versions: torch.Tensor, policy_version: int) -> torch.Tensor:
    """``[N]`` bool: the tokens whose lag is known (a span covers them, not from the future)."""
    return (generating_versions >= 0) & (generating_versions <= policy_version)


def lag_sums(
    generating_versions: torch.Tensor, importance_ratio: torch.Tensor, policy_version: int
) -> dict[str, float]:
    """Sums over trained tokens (both arguments ``[N]``, one entry per token; -1: no
    version): tokens and importance ratios per lag bucket, tokens of unknown lag, and the
    lags themselves (for the mean)."""
    known = known_lags(generating_versions, policy_version)
    lags = policy_version - generating_versions[known]
    buckets = lags.clamp(max=len(LAG_BUCKETS) - 1)
    num_buckets = len(LAG_BUCKETS)
    tokens = torch.bincount(buckets, minlength=num_buckets).tolist()
    ratios = torch.bincount(
        buckets, weights=importance_ratio[known].double(), minlength=num_buckets
    ).tolist()
    sums = {f"tokens_lag{bucket}": float(n) for bucket, n in zip(LAG_BUCKETS, tokens, strict=True)}
    sums |= {f"ratio_lag{bucket}": r for bucket, r in zip(LAG_BUCKETS, ratios, strict=True)}
    sums["tokens_lag_unknown"] = float((~known).sum())
    sums["lag"] = float(lags.sum())
    return sums


def max_lag(generating_versions: torch.Tensor, policy_version: int) -> int:
    """The largest known lag of the tokens (0 when none is known)."""
    known = generating_versions[known_lags(generating_versions, policy_version)]
    return policy_version - int(known.min()) if known.numel() else 0


def lag_metrics(total: Mapping[str, float], largest_lag: float) -> dict[str, float]:
    """The step's figures from its summed ``lag_sums``: ``tokens_lag<bucket>`` (trained
    tokens of that lag), ``tokens_lag_unknown``, ``is_ratio_mean_lag<bucket>`` (their
    mean importance ratio; 0 with no token), ``version_lag_mean`` and ``version_lag_max``
    (over tokens of known lag)."""
    metrics: dict[str, float] = {}
    for bucket in LAG_BUCKETS:
        num_tokens = total[f"tokens_lag{bucket}"]
        metrics[f"tokens_lag{bucket}"] = num_tokens
        metrics[f"is_ratio_mean_lag{bucket}"] = (
            total[f"ratio_lag{bucket}"] / num_tokens if num_tokens else 0.0
        )
    num_known = sum(total[f"tokens_lag{bucket}"] for bucket in LAG_BUCKETS)
    metrics["tokens_lag_unknown"] = total["tokens_lag_unknown"]
    metrics["version_lag_mean"] = total["lag"] / num_known if num_known else 0.0
    metrics["version_lag_max"] = largest_lag
    return metrics

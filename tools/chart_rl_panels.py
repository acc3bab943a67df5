"""Panels of the RL loop: rollouts (envs), training (trainer), weight sync (trainer and
inference) and evals. tools/chart_dashboards.py arranges them into dashboards; how each
source aggregates across pods is said in tools/chart_panels.py.
"""

from __future__ import annotations

from chart_panels import (
    RATE,
    SEL,
    Panel,
    increase,
    panel,
    quantiles,
    row,
    step_metric,
)

TRAINER_NOTE = "The last step's figure (reduced over every rank, so every trainer pod shows it)."
EVALS_NOTE = (
    "The newest scored policy version of each suite: the lines step when a newer version is "
    "scored. The evals report (`etude evals report`) plots every version."
)
# Publishes are a step apart, often longer than a rate interval: ratios use a fixed window.
RATIO_WINDOW = "[1h]"
# The weight-exchange metrics are declared in both processes that use the module (the
# trainer publishes, inference loads); the idle side exports zeros.
TRAINER = f'component="trainer", {SEL}'
INFERENCE = f'component="inference", {SEL}'


# -- weight updates (inference side) -----------------------------------------------


def update_pause_panel() -> Panel:
    return panel(
        "Generation paused per weight update",
        quantiles("etude_inference_update_pause_seconds", "", SEL, (0.5, 0.99)),
        unit="s",
        description="Requests are kept while a replica loads a version; this is how long "
        "their generation stood still.",
    )


def update_lag_panel() -> Panel:
    return panel(
        "Update lag (manifest written to serving)",
        quantiles("etude_inference_update_lag_seconds", "", SEL, (0.5, 0.9, 0.99)),
        unit="s",
    )


def versions_panel() -> Panel:
    return panel(
        "Published and served policy version",
        [
            (f"max(etude_trainer_published_version{{{SEL}}})", "published"),
            (f"max(etude_inference_serving_version{{{SEL}}})", "served, newest replica"),
            (f"min(etude_inference_serving_version{{{SEL}}})", "served, oldest replica"),
        ],
        description="A region that runs inference without the trainer shows no published line.",
    )


def inference_update_panels() -> list[Panel]:
    return [
        panel(
            "Serving version",
            [(f"min(etude_inference_serving_version{{{SEL}}})", "oldest replica")],
            kind="stat",
        ),
        panel(
            "Routed-expert capture on",
            [(f"min(etude_inference_routed_experts_capture{{{SEL}}})", "capture")],
            kind="stat",
            description="1 when every replica records routed experts for router replay.",
        ),
        panel(
            "Serving version by pod",
            [(f"max by (pod) (etude_inference_serving_version{{{SEL}}})", "{{pod}}")],
        ),
        versions_panel(),
        update_pause_panel(),
        update_lag_panel(),
        panel(
            "Update failures by reason",
            [(increase("etude_inference_update_failures_total", "reason"), "{{reason}}")],
            description="Versions a replica could not load; it keeps serving the one it has.",
        ),
        panel(
            "Keyframe fallbacks by reason",
            [
                (
                    increase("etude_weights_keyframe_fallbacks_total", "reason", INFERENCE),
                    "{{reason}}",
                )
            ],
            description="Loads rebuilt from the keyframes because the cached weights did not "
            "match the delta's base.",
        ),
        panel(
            "Weight bytes downloaded/s",
            [
                (
                    f"sum(rate(etude_weights_downloaded_bytes_total{{{INFERENCE}}}{RATE}))",
                    "downloaded",
                )
            ],
            unit="Bps",
        ),
        panel(
            "Decoding one version",
            quantiles("etude_weights_decode_seconds", "", INFERENCE, (0.5, 0.99)),
            unit="s",
        ),
        panel(
            "Generated tokens/s by pod",
            [
                (
                    f"sum by (pod) (rate(etude_inference_generated_tokens_total{{{SEL}}}{RATE}))",
                    "{{pod}}",
                )
            ],
        ),
    ]


# -- weight publishing (trainer side) ----------------------------------------------


def weight_bytes_panels() -> list[Panel]:
    uploaded = f"etude_weights_uploaded_bytes_total{{{TRAINER}}}"
    raw = f"etude_weights_raw_bytes_total{{{TRAINER}}}"
    return [
        panel(
            "Weight bytes published/s: stored vs full",
            [
                (f"sum by (kind) (rate({uploaded}{RATE}))", "{{kind}} stored"),
                (f"sum by (kind) (rate({raw}{RATE}))", "{{kind}} full"),
            ],
            unit="Bps",
            description="Full is the tensors' own size; stored is what was uploaded "
            "(compressed keyframes, XOR deltas against the last version).",
        ),
        panel(
            "Stored / full bytes (delta ratio)",
            [
                (
                    f"sum by (kind) (increase({uploaded}{RATIO_WINDOW}))"
                    f" / sum by (kind) (increase({raw}{RATIO_WINDOW}))",
                    "{{kind}}, last hour",
                ),
                (f"avg(etude_weights_compression_ratio{{{TRAINER}}})", "last version"),
            ],
            unit="percentunit",
            description="Lower is better: the delta line is what delta encoding saves over "
            "sending the weights whole.",
        ),
    ]


def publish_lag_panel() -> Panel:
    return panel(
        "Weight publish lag (snapshot to manifest)",
        quantiles("etude_weights_publish_lag_seconds", "", TRAINER, (0.5, 0.9, 0.99)),
        unit="s",
        description="From the trainer's snapshot of a version to its manifest and `latest` "
        "pointer being written.",
    )


def weight_failures_panel() -> Panel:
    return panel(
        "Weight publish and update failures",
        [
            (increase("etude_weights_publish_failures_total", "", TRAINER), "publish failures"),
            (
                increase("etude_inference_update_failures_total", "reason"),
                "update failures: {{reason}}",
            ),
            (
                increase("etude_weights_keyframe_fallbacks_total", "reason", INFERENCE),
                "keyframe fallbacks: {{reason}}",
            ),
        ],
    )


def trainer_publish_panels() -> list[Panel]:
    return [
        publish_lag_panel(),
        panel(
            "Encoding and uploading one shard",
            [
                *quantiles("etude_weights_encode_seconds", "", TRAINER, (0.5, 0.99), "encode "),
                *quantiles("etude_weights_upload_seconds", "", TRAINER, (0.5, 0.99), "upload "),
            ],
            unit="s",
        ),
        *weight_bytes_panels(),
        panel(
            "Publish failures",
            [(increase("etude_weights_publish_failures_total", "", TRAINER), "failures")],
            description="Versions given up after every try; training goes on.",
        ),
    ]


# -- trainer -----------------------------------------------------------------------


def trainer_step_panels() -> list[Panel]:
    return [
        panel("Trainer step", [(f"max(etude_trainer_step{{{SEL}}})", "step")], kind="stat"),
        panel(
            "Trainer policy version",
            [(f"max(etude_trainer_policy_version{{{SEL}}})", "version")],
            kind="stat",
        ),
        panel(
            "Published version",
            [(f"max(etude_trainer_published_version{{{SEL}}})", "version")],
            kind="stat",
        ),
        panel(
            "Loss by part",
            [step_metric("loss|loss_pg|loss_kl|loss_mtp")],
            description=TRAINER_NOTE,
        ),
        panel(
            "Time per step by part",
            quantiles("etude_trainer_step_seconds", "part", SEL, (0.5, 0.9)),
            unit="s",
            description="Waiting for data, compute, publishing weights, saving checkpoints.",
        ),
    ]


def trainer_panels() -> list[Panel]:
    seconds = f"etude_trainer_step_seconds_sum{{{SEL}}}"
    return [
        row("Steps"),
        *trainer_step_panels(),
        panel(
            "Share of time waiting for data",
            [
                (
                    f'sum(rate(etude_trainer_step_seconds_sum{{part="wait", {SEL}}}{RATE}))'
                    f" / sum(rate({seconds}{RATE}))",
                    "waiting",
                )
            ],
            unit="percentunit",
            description="High: the rollouts do not keep up (add envs or inference replicas).",
        ),
        panel("Tokens/s", [step_metric("tokens_per_s")], description=TRAINER_NOTE),
        panel("Tokens per step", [step_metric("tokens|tokens_trained")]),
        row("Optimisation"),
        panel("KL to the reference (mean k1 per token)", [step_metric("kl")]),
        panel("Entropy", [step_metric("entropy")]),
        panel("Gradient norm", [step_metric("grad_norm")]),
        panel("Learning rate", [step_metric("lr")]),
        panel(
            "Importance ratio",
            [step_metric("is_ratio_mean|is_ratio_max")],
            description="Trainer over behaviour probability of the sampled tokens.",
        ),
        panel(
            "Clipped ratios and train/inference logprob mismatch",
            [step_metric("is_clipped_fraction|logprob_mismatch")],
        ),
        panel(
            "Router replay",
            [step_metric("replay_token_fraction|replay_replacement_rate")],
            unit="percentunit",
            description="Tokens routed as inference routed them; replayed experts replaced "
            "because the router found them implausible.",
        ),
        row("Batches"),
        panel(
            "Reward of trained rollouts by part (mean)",
            [step_metric("reward_.*_mean")],
            description=TRAINER_NOTE,
        ),
        panel("Advantages", [step_metric("advantage_mean|advantage_std|advantage_abs_mean")]),
        panel("Groups and rollouts per step", [step_metric("groups|rollouts")]),
        panel(
            "Staleness of trained groups (mean, policy versions)",
            [step_metric("staleness_mean")],
        ),
        panel(
            "Groups and rollouts left out by reason",
            [(increase("etude_trainer_skipped_total", "reason"), "{{reason}}")],
        ),
        row("Weight publishing"),
        *trainer_publish_panels(),
    ]


# -- evals -------------------------------------------------------------------------


def pass_at_1_panel() -> Panel:
    return panel(
        "pass@1 by suite and scored policy version",
        [
            (f"max by (suite) (etude_evals_pass_at_1{{{SEL}}})", "{{suite}} pass@1"),
            (f"max by (suite) (etude_evals_version{{{SEL}}})", "{{suite}} version"),
        ],
        unit="percentunit",
        right_axis="version",
        description=EVALS_NOTE + " The version is on the right axis.",
    )


def evals_panels() -> list[Panel]:
    return [
        row("Scores of the newest scored version"),
        panel(
            "Newest scored version",
            [(f"max(etude_evals_version{{{SEL}}})", "version")],
            kind="stat",
        ),
        panel(
            "Evals running",
            [(f"sum(etude_evals_running{{{SEL}}})", "running")],
            kind="stat",
        ),
        pass_at_1_panel(),
        panel(
            "pass@k by suite",
            [(f"max by (suite, k) (etude_evals_pass_at_k{{{SEL}}})", "{{suite}} pass@{{k}}")],
            unit="percentunit",
            description=EVALS_NOTE,
        ),
        panel(
            "Best-of-K grader score by suite",
            [(f"max by (suite) (etude_evals_best_of_k{{{SEL}}})", "{{suite}}")],
            description=EVALS_NOTE,
        ),
        panel(
            "Mean reward by suite and part",
            [(f"max by (suite, part) (etude_evals_mean_reward{{{SEL}}})", "{{suite}} {{part}}")],
            description=EVALS_NOTE,
        ),
        panel(
            "Generated tokens per rollout",
            [(f"max by (suite) (etude_evals_mean_tokens{{{SEL}}})", "{{suite}}")],
        ),
        panel(
            "Turns, tool calls and summaries per rollout",
            [
                (f"max by (suite) (etude_evals_mean_turns{{{SEL}}})", "{{suite}} turns"),
                (f"max by (suite) (etude_evals_mean_tool_calls{{{SEL}}})", "{{suite}} tool calls"),
                (f"max by (suite) (etude_evals_mean_summaries{{{SEL}}})", "{{suite}} summaries"),
            ],
        ),
        panel(
            "Incorrect samples by reason",
            [(f"max by (suite, reason) (etude_evals_failures{{{SEL}}})", "{{suite}} {{reason}}")],
        ),
        panel(
            "Tasks left unscored (group dropped)",
            [(f"max by (suite) (etude_evals_dropped_tasks{{{SEL}}})", "{{suite}}")],
        ),
        row("Runs"),
        panel(
            "Evals finished by outcome",
            [(increase("etude_evals_runs_total", "suite, state"), "{{suite}} {{state}}")],
        ),
        panel(
            "Eval duration (submission to scored)",
            quantiles("etude_evals_duration_seconds", "suite", SEL, (0.5, 0.9)),
            unit="s",
        ),
    ]


# -- envs --------------------------------------------------------------------------


def envs_reward_panel() -> Panel:
    return panel(
        "Reward of graded rollouts by part (mean of the last 100 per pod)",
        [(f"avg by (part) (etude_envs_reward_mean{{{SEL}}})", "{{part}}")],
        description="Every rollout the envs workers graded, training and eval alike; "
        "each pod's mean over its last 100, averaged over pods.",
    )


def envs_panels() -> list[Panel]:
    graded = f"scalar(sum(rate(etude_envs_rollout_seconds_count{{{SEL}}}{RATE})))"
    return [
        row("Rollouts"),
        panel(
            "Rollouts/s by outcome",
            [
                (
                    f"sum by (outcome) (rate(etude_envs_rollouts_total{{{SEL}}}{RATE}))",
                    "{{outcome}}",
                )
            ],
            unit="ops",
            description="failed: the attempt raised and the slot is retried; lease_lost: the "
            "result was dropped (another worker owns the slot); refused: the reconciler "
            "refused the completion.",
        ),
        panel(
            "Rollouts in progress",
            [(f"sum(etude_envs_rollouts_in_progress{{{SEL}}})", "running")],
        ),
        panel(
            "Rollout duration (claim to record stored)",
            quantiles("etude_envs_rollout_seconds", "", SEL, (0.5, 0.9, 0.99)),
            unit="s",
        ),
        envs_reward_panel(),
        panel(
            "Why the agent loop ended",
            [
                (
                    f"sum by (reason) (rate(etude_envs_finish_reasons_total{{{SEL}}}{RATE}))",
                    "{{reason}}",
                )
            ],
            unit="ops",
            stack=True,
        ),
        panel(
            "Tool calls per rollout by tool",
            [
                (
                    f"sum by (tool) (rate(etude_envs_tool_calls_total{{{SEL}}}{RATE})) / {graded}",
                    "{{tool}}",
                )
            ],
            stack=True,
        ),
        panel(
            "Tokens per rollout by kind",
            [
                (
                    f"sum by (kind) (rate(etude_envs_rollout_tokens_total{{{SEL}}}{RATE}))"
                    f" / {graded}",
                    "{{kind}}",
                )
            ],
        ),
        row("Failures"),
        panel(
            "Rollout errors by type",
            [(increase("etude_envs_rollout_errors_total", "error"), "{{error}}")],
            description="Faults of an attempt (inference down, a sandbox that failed to "
            "start): the slot is failed with the reason and retried.",
        ),
        panel(
            "Gradings that did not run to the end",
            [(increase("etude_envs_grading_failures_total", "reason"), "{{reason}}")],
            description="The tests timed out, crashed or could not import the code; the "
            "rollout scores 0.",
        ),
    ]

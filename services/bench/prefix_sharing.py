"""`etude bench prefix-sharing`: trainer steps on prefix trees against whole sequences.

The batches are what the local run trains on, made from the synthetic family's training
tasks in the harness's exact token layout (``services.launcher.base_model``'s
transcripts: system prompt, task, ``write_file`` with the solution, the tool's answer,
``finish``), on the ``small`` preset with fresh weights, one thread, the trainer's
compute dtype (``auto``):

* **RL**: ``groups`` groups of ``K`` rollouts (the committed 8 x 4), every rollout of a
  group the task's transcript, its generated tokens trained with an advantage; one
  ``Learner.rl_step`` (forward and backward, the reference model's forward for the KL,
  the optimizer step) packed whole (the baseline) and as a prefix tree;
* **SFT**: one step of the base model's SFT data (``sft_records``: a task's ``write_file``
  turn after its prompt, and for some tasks the ``finish`` turn after the whole
  transcript), 8,192 tokens as ``[launcher.base_model]`` takes them.

Figures: ``rl_step_speedup`` and ``sft_step_speedup`` (whole / tree seconds, best of a
few runs taken alternately; target: the RL step at least 1.5x faster), and the share of
tokens the tree computes (``*_computed_fraction``). The two losses are reported too:
the tree changes where float additions happen, not what is computed.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.bench import BenchResult

if TYPE_CHECKING:
    from services.trainer.batch import TrainItem
    from services.trainer.learner import Learner

TARGET_RL_SPEEDUP = 1.5
NUM_GROUPS, GROUP_SIZE = 8, 4


def _transcripts(tokenizer: object, num_tasks: int) -> list[tuple[list[int], list[bool]]]:
    """Token ids of whole task transcripts and which tokens the assistant generated."""
    from services.families import CANONICAL_KEY
    from services.families.synthetic import make_task
    from services.launcher.base_model import transcript_examples

    transcripts = []
    for position in range(num_tasks):
        task = make_task("train", position, seed=0)
        write, finish = transcript_examples(task.instruction, task.metadata[CANONICAL_KEY])
        pieces = [(write["prompt"], False), (write["completion"], True)]
        pieces += [(finish["prompt"][len(write["prompt"] + write["completion"]) :], False)]
        pieces += [(finish["completion"], True)]
        tokens: list[int] = []
        generated: list[bool] = []
        for text, is_generated in pieces:
            ids = tokenizer.encode(text).ids  # type: ignore[attr-defined]
            tokens += ids
            generated += [is_generated] * len(ids)
        transcripts.append((tokens, generated))
    return transcripts


def rl_items(tokenizer: object, num_groups: int) -> list[TrainItem]:
    """GROUP_SIZE rollouts of each of `num_groups` transcripts (a group shares its whole
    transcript), with advantages that differ within and across groups."""
    from services.trainer.rollouts import SegmentTokens

    items: list[TrainItem] = []
    for group, (tokens, generated) in enumerate(_transcripts(tokenizer, num_groups)):
        for sample in range(GROUP_SIZE):
            segment = SegmentTokens(
                input_ids=tokens[:-1],
                targets=tokens[1:],
                trained=generated[1:],
                behaviour_logprobs=[-0.5] * (len(tokens) - 1),
                replay=None,
            )
            items.append((segment, 0.1 * (sample - 1.5) + 0.01 * group, 1.0))
    return items


def small_learner(scratch: Path) -> tuple[Any, Learner]:
    """The tokenizer and an RL learner (its reference a frozen copy) of a fresh `small`
    preset model made under ``scratch``: what both trainer benchmarks step."""
    from tokenizers import Tokenizer

    from services.config.trainer import JobConfig
    from services.model_factory.build import init_model
    from services.trainer.learner import Learner
    from services.trainer.model import load_pretrained, resolve_compute_dtype

    model_dir = scratch / "small"
    init_model("small", model_dir, seed=0)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    job = JobConfig.model_validate(
        {
            "phase": "rl",
            "optimizer": {"lr": 1e-6},
            "rl": {"kl_coef": 0.01, "generation_budget_tokens": 512},
        }
    )
    model = load_pretrained(model_dir, dtype=resolve_compute_dtype(job.model.compute_dtype))
    return tokenizer, Learner(model, job, copy.deepcopy(model).requires_grad_(False))


def _best(calls: dict[str, Callable[[], float]], repeats: int) -> dict[str, tuple[float, float]]:
    """Best seconds of each call over ``repeats`` rounds (calls alternate), and its loss."""
    best: dict[str, tuple[float, float]] = {}
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            loss = call()
            seconds = time.perf_counter() - started
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, loss)
    return best


def run(quick: bool) -> BenchResult:
    """RL and SFT step seconds with and without prefix sharing, in one process."""
    from services.config.launcher import BaseModelConfig
    from services.launcher.base_model import sft_records
    from services.trainer.batch import RLBatch, pack_microbatch
    from services.trainer.sft import ExampleStream, JsonlSource, to_microbatch

    torch.set_num_threads(1)
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="etude-bench-prefix-") as scratch:
        tokenizer, learner = small_learner(Path(scratch))
        model, dtype = learner.model, learner.model.dtype
        arch = model.arch

        items = rl_items(tokenizer, NUM_GROUPS)
        rl_batches = {
            share: RLBatch(
                [pack_microbatch(items, arch.num_layers, arch.top_k, share_prefixes=share)],
                num_rollouts=len(items),
                rewards=[],
                advantages=[],
                group_weights=[],
            )
            for share in (False, True)
        }
        settings = BaseModelConfig()  # one SFT step as the base-model build takes it
        records = Path(scratch) / "sft.jsonl"
        records.write_text(
            "".join(
                json.dumps(record) + "\n"
                for record in sft_records(0, 200, settings.sft_flawed_fraction)
            )
        )
        source = JsonlSource(tokenizer, max_seq_len=settings.max_seq_len, path=records)
        examples = ExampleStream(source, settings.tokens_per_step).next_batch()
        sft_batches = {
            share: to_microbatch(examples, share_prefixes=share) for share in (False, True)
        }

        def rl(share: bool) -> Callable[[], float]:
            return lambda: learner.rl_step(rl_batches[share], 0)["loss"]

        def sft(share: bool) -> Callable[[], float]:
            return lambda: learner.sft_step([sft_batches[share]], 0)["loss"]

        rl(True)()  # warm-up: the first step pays for allocations and kernel selection
        sft(True)()
        timed = _best(
            {
                "rl_whole": rl(False),
                "rl_tree": rl(True),
                "sft_whole": sft(False),
                "sft_tree": sft(True),
            },
            repeats,
        )

    trees = {"rl": rl_batches[True].microbatches[0], "sft": sft_batches[True]}
    speedup = {name: timed[f"{name}_whole"][0] / timed[f"{name}_tree"][0] for name in trees}

    def described(name: str, count: dict[str, int]) -> dict[str, float]:
        tree = trees[name]
        return {
            **count,
            "tokens": tree.num_data_tokens,
            "tokens_computed": tree.num_tokens,
            "loss_whole": timed[f"{name}_whole"][1],
            "loss_tree": timed[f"{name}_tree"][1],
        }

    return BenchResult(
        figures={
            **{f"{name}_step_speedup": round(value, 3) for name, value in speedup.items()},
            **{
                f"{name}_computed_fraction": round(tree.num_tokens / tree.num_data_tokens, 4)
                for name, tree in trees.items()
            },
            **{f"{name}_step_seconds": round(timed[f"{name}_tree"][0], 3) for name in trees},
        },
        baseline={f"{name}_step_seconds": round(timed[f"{name}_whole"][0], 3) for name in trees},
        ok=speedup["rl"] >= TARGET_RL_SPEEDUP,
        target=f"rl_step_speedup >= {TARGET_RL_SPEEDUP:g} ({NUM_GROUPS} groups x {GROUP_SIZE})",
        details={
            "model": f"small preset, fresh weights, {str(dtype).removeprefix('torch.')}, 1 thread",
            "rl": described("rl", {"rollouts": len(items)}),
            "sft": described("sft", {"examples": len(examples)}),
            "repeats": repeats,
        },
    )

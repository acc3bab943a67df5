"""The base model of a local run: a factory model, continued pretraining, then SFT.

The report's recipe in miniature. ``etude run`` builds it once, at
``inference.engine.model_dir``, when no model is there:

1. ``init``: ``etude model init`` — a BPE tokenizer trained on the generated code corpus
   and randomly initialised Qwen3-MoE weights;
2. ``cpt``: continued pretraining on that corpus (Python modules and harness
   transcripts), every token trained;
3. ``sft``: supervised fine-tuning on agent transcripts of synthetic *training* tasks in
   the harness's exact format (system prompt, task, ``write_file`` with the teacher's
   solution, the tool's answer, ``finish``), trained on the assistant's tokens only.

The teacher is imperfect, as demonstration data is: in ``sft_flawed_fraction`` of its
transcripts it prints its result where it should return it (a beginner's habit, the
same in every template). Imitation learns the habit along with everything else; RL,
whose reward runs the tests, is what can unlearn it. A fraction of 0 gives a flawless
teacher.

Each stage is a complete HF model directory under ``<model_dir>.stages/`` (written
aside and renamed), so an interrupted build resumes at the stage it was in. The
stages use the trainer's own ``Learner`` and data stream: the same code as the
trainer service's cpt/sft phases, run in-process because nothing else is up yet.
Held-out tasks never enter the SFT data (the synthetic family splits by behaviour).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from services.config.envs import HarnessConfig
from services.config.launcher import BaseModelConfig
from services.model_factory.presets import ModelPreset, PresetName

STAGES = ("init", "cpt", "sft")
SOLUTION_PATH = "solution.py"
# Every task's write_file turn is trained; the closing `finish` turn, the same few tokens
# after a prompt twice as long, only for one task in this many (it is learnt at once).
FINISH_EVERY = 4
_RETURN = re.compile(r"^(\s*)return (.+)$", re.MULTILINE)
# Without a terminal a progress bar draws only when it stops: a stage prints a plain
# line this often instead (a 48-layer shaped model's SFT stage runs half an hour).
PLAIN_PROGRESS_EVERY_S = 30.0


def _turn(*pieces: str) -> str:
    return "".join(pieces)


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<|tool_call|>" + json.dumps({"name": name, "arguments": arguments}) + "<|/tool_call|>"


def transcript_examples(instruction: str, solution: str) -> list[dict[str, str]]:
    """The SFT examples of one solved task: each assistant turn, after what precedes it.

    The prompt is laid out exactly as ``Harness.prompt`` lays out a context, and the
    tool's answer exactly as the harness injects it, so SFT trains the turns the model
    will take in RL.
    """
    from services.envs.harness import SYSTEM_PROMPT

    prompt = _turn(
        "<|system|>",
        SYSTEM_PROMPT,
        "<|end_of_turn|><|user|>",
        instruction,
        "<|end_of_turn|><|assistant|>",
    )
    write = _call("write_file", {"path": SOLUTION_PATH, "content": solution}) + "<|end_of_turn|>"
    answer = _turn(
        "<|tool|><|tool_result|>",
        f"wrote {SOLUTION_PATH} ({len(solution.encode())} bytes)",
        "<|/tool_result|><|end_of_turn|><|assistant|>",
    )
    finish = _call("finish", {"message": "done"}) + "<|end_of_turn|>"
    return [
        {"prompt": prompt, "completion": write},
        {"prompt": prompt + write + answer, "completion": finish},
    ]


def printing_instead_of_returning(source: str) -> str:
    """``source`` with every ``return x`` made ``print(x)``: the teacher's flaw."""
    flawed = _RETURN.sub(r"\1print(\2)", source)
    if flawed == source:
        raise ValueError(f"no return statement to flaw in:\n{source}")
    return flawed


def sft_records(
    seed: int, num_tasks: int, flawed_fraction: float = 0.0
) -> Iterator[dict[str, str]]:
    """SFT examples from the first ``num_tasks`` synthetic training tasks of ``seed``;
    the solution of a task prints instead of returning with probability
    ``flawed_fraction`` (drawn from ``seed`` and the task's position)."""
    from services.families import CANONICAL_KEY
    from services.families.synthetic import make_task

    if not 0.0 <= flawed_fraction <= 1.0:
        raise ValueError(f"flawed_fraction must be in [0, 1], got {flawed_fraction}")
    for position in range(num_tasks):
        task = make_task("train", position, seed)
        solution = task.metadata[CANONICAL_KEY]
        if random.Random(f"teacher:{seed}:{position}").random() < flawed_fraction:
            solution = printing_instead_of_returning(solution)
        write, finish = transcript_examples(task.instruction, solution)
        yield write
        if position % FINISH_EVERY == 0:
            yield finish


def interleaved(first: list[Any], second: list[Any]) -> list[Any]:
    """`first` with `second`'s items spread evenly among its own, each list's order kept."""
    merged: list[Any] = []
    taken = 0
    for index, item in enumerate(first):
        due = (index + 1) * len(second) // (len(first) + 1)
        merged += second[taken:due]
        taken = due
        merged.append(item)
    return merged + second[taken:]


def multifile_lines(
    settings: BaseModelConfig, tokenizer_dir: Path, harness: HarnessConfig
) -> list[dict[str, list[int]]]:
    """The teacher's transcripts of the first ``sft_multifile_tasks`` multifile training
    tasks, in the model's ids; a context longer than SFT's max_seq_len is refused."""
    from transformers import AutoTokenizer

    from services.launcher.teacher import multifile_sft_records

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    max_seq_len = settings.sft_max_seq_len or settings.max_seq_len
    lines = list(
        multifile_sft_records(settings.seed, settings.sft_multifile_tasks, tokenizer, harness)
    )
    longest = max((len(line["token_ids"]) for line in lines), default=0)
    if longest > max_seq_len:
        raise ValueError(
            f"a multifile transcript context has {longest} tokens, more than SFT's "
            f"max_seq_len {max_seq_len}: cut, it would lose the summary at its end; raise "
            "launcher.base_model.sft_max_seq_len to at least the multifile context_tokens "
            f"({harness.for_family('multifile').context_tokens})"
        )
    return lines


@dataclass
class StageReport:
    """What one stage did."""

    stage: str
    steps: int
    seconds: float
    first_loss: float
    last_loss: float


def _train_stage(
    stage: str,
    source_dir: Path,
    out: Path,
    data: dict[str, Any],
    *,
    steps: int,
    lr: float,
    settings: BaseModelConfig,
    console: Console,
) -> StageReport:
    """``steps`` next-token steps from ``source_dir``; the result saved at ``out``."""
    import torch

    from services.config.trainer import JobConfig
    from services.trainer.learner import Learner
    from services.trainer.model import save_pretrained
    from services.trainer.sft import ExampleStream, open_source, to_microbatch

    job = JobConfig.model_validate(
        {
            "phase": stage,
            "model": {"compute_dtype": settings.compute_dtype},
            "optimizer": {
                "lr": lr,
                "warmup_steps": settings.warmup_steps,
                "weight_decay": 0.0,
                "max_grad_norm": 1.0,
            },
            "data": data,
            "max_steps": steps,
            "seed": settings.seed,
        }
    )
    assert job.data is not None
    torch.manual_seed(settings.seed)
    learner = Learner.load(source_dir, job)
    stream = ExampleStream(open_source(job.data, source_dir), job.data.tokens_per_step)
    started = last_line = time.perf_counter()
    losses: list[float] = []
    columns = (
        TextColumn(f"[bold]{stage}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(stage, total=steps, loss="-")
        for step in range(steps):
            examples = stream.next_batch()
            if not examples:  # a finite source restarts: several epochs of SFT data
                stream = ExampleStream(open_source(job.data, source_dir), job.data.tokens_per_step)
                examples = stream.next_batch()
            microbatch = to_microbatch(examples, share_prefixes=job.shares_prefixes)
            metrics = learner.sft_step([microbatch], step)
            losses.append(metrics["loss"])
            progress.update(bar, advance=1, loss=f"{metrics['loss']:.3f}")
            if not console.is_terminal and (
                time.perf_counter() - last_line >= PLAIN_PROGRESS_EVERY_S or step + 1 == steps
            ):
                last_line = time.perf_counter()
                console.print(
                    f"{stage}: step {step + 1}/{steps}, loss {metrics['loss']:.3f}, "
                    f"{last_line - started:.0f} s"
                )
    save_pretrained(learner.model, out, source_dir=source_dir, policy_version=0)
    first, last = (losses[0], losses[-1]) if losses else (float("nan"), float("nan"))
    return StageReport(stage, steps, time.perf_counter() - started, first, last)


def build_base_model(
    preset: PresetName | ModelPreset,
    model_dir: Path,
    settings: BaseModelConfig,
    console: Console,
    harness: HarnessConfig | None = None,
) -> list[StageReport]:
    """Builds the model at ``model_dir`` (the SFT stage's output) from a factory model of
    ``preset`` (a preset's name or a shape of its own); resumes finished stages.
    `harness`: the budgets the multifile transcripts are made under (the run's
    ``envs.harness``)."""
    from services.model_factory.build import init_model

    label = preset if isinstance(preset, str) else "custom"  # as the model card names it

    stages = stages_dir(model_dir)
    stages.mkdir(parents=True, exist_ok=True)
    reports: list[StageReport] = []
    init_dir, cpt_dir = stages / "init", stages / "cpt"
    if not (init_dir / "config.json").is_file():
        with console.status(f"creating a {label} model") as status:
            init_model(
                preset,
                init_dir,
                seed=settings.seed,
                overwrite=True,
                progress=lambda message: status.update(message),
            )
        console.print(f"base model: created the {label} factory model at {init_dir}")
    if not (cpt_dir / "config.json").is_file():
        reports.append(
            _train_stage(
                "cpt",
                init_dir,
                cpt_dir,
                {
                    "kind": "corpus",
                    "seed": settings.seed,
                    "tokens_per_step": settings.tokens_per_step,
                    "max_seq_len": settings.max_seq_len,
                },
                steps=settings.cpt_steps,
                lr=settings.cpt_lr,
                settings=settings,
                console=console,
            )
        )
    data_file = stages / "sft.jsonl"
    partial = data_file.with_suffix(".jsonl.partial")
    records: list[Any] = list(
        sft_records(settings.seed, settings.sft_tasks, settings.sft_flawed_fraction)
    )
    if settings.sft_multifile_tasks:
        with console.status("base model: the teacher's multifile transcripts"):
            lines = multifile_lines(settings, init_dir, harness or HarnessConfig())
        console.print(
            f"base model: {len(lines)} multifile contexts from {settings.sft_multifile_tasks} "
            f"tasks among {len(records)} SFT examples"
        )
        records = interleaved(records, lines)
    with partial.open("w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    partial.replace(data_file)
    reports.append(
        _train_stage(
            "sft",
            cpt_dir,
            model_dir,
            {
                "kind": "jsonl",
                "path": str(data_file),
                "tokens_per_step": settings.tokens_per_step,
                "max_seq_len": settings.sft_max_seq_len or settings.max_seq_len,
            },
            steps=settings.sft_steps,
            lr=settings.sft_lr,
            settings=settings,
            console=console,
        )
    )
    for report in reports:
        console.print(
            f"base model: {report.stage} {report.steps} steps in {report.seconds:.0f} s, "
            f"loss {report.first_loss:.3f} -> {report.last_loss:.3f}"
        )
    return reports


def stages_dir(model_dir: Path) -> Path:
    """``<model_dir>.stages``: the earlier stages' models, beside the base model."""
    return model_dir.parent / f"{model_dir.name}.stages"


def stage_dirs(model_dir: Path) -> dict[str, Path]:
    """Where each stage's model lives (``sft`` is ``model_dir`` itself)."""
    stages = stages_dir(model_dir)
    return {"init": stages / "init", "cpt": stages / "cpt", "sft": model_dir}


def remove_base_model(model_dir: Path) -> None:
    """Deletes the model and its stages (``etude run --fresh --rebuild-model``)."""
    for path in (model_dir, stages_dir(model_dir)):
        shutil.rmtree(path, ignore_errors=True)

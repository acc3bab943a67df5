"""The trainer's structure: the job in one process is the distributed job on a runtime of
one rank, and nothing under ``services/trainer/`` imports the trainer's service module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from services.trainer.runtime import LocalRuntime
from tests.conftest import REPO


def test_the_local_runtime_is_rank_0_of_one_with_pass_through_collectives() -> None:
    runtime = LocalRuntime()
    assert (runtime.rank, runtime.world_size, runtime.dp_index, runtime.cp_index) == (0, 1, 0, 0)
    assert runtime.is_leader and runtime.serves_http
    assert runtime.share({"a": 1}) == {"a": 1}
    assert runtime.scatter(["only"]) == "only"
    assert runtime.all_reduce([1.5, 2.0], "max") == [1.5, 2.0]
    model = torch.nn.Linear(2, 1)
    assert runtime.parallelize(model) is model  # type: ignore[arg-type]
    model(torch.ones(1, 2)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    norm = runtime.clip_and_step(model, [optimizer], max_grad_norm=0.0)
    assert abs(norm - 3**0.5) < 1e-6  # gradients (1, 1) and 1
    assert all(p.grad is None for p in model.parameters())


def test_no_trainer_module_imports_the_service_module() -> None:
    """Not even inside a function: the service builds the runtime and hands it in."""
    service = "services.trainer.service"
    importers = []
    for path in sorted((REPO / "services" / "trainer").rglob("*.py")):
        if path.name == "service.py" and path.parent.name == "trainer":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if service in names:
                importers.append(str(path.relative_to(REPO)))
    assert importers == []


def test_an_idle_trainer_lists_checkpoints_without_torch(tmp_path: Path) -> None:
    """ListCheckpoints of a trainer without a job reads metadata and manifests only: its
    first answer must not wait seconds for torch to import (the fuzz suite's deadline)."""
    code = (
        "import sys\n"
        "from services.config.deployment import EtudeConfig\n"
        "from services.objectstore.factory import open_store\n"
        "from services.trainer.checkpoint_index import list_checkpoints\n"
        "import services.trainer.service\n"
        f"config = EtudeConfig.model_validate({{'run': {{'state_dir': {str(tmp_path)!r}}},"
        f" 'object_store': {{'url': 'file://{tmp_path}/store'}}}})\n"
        "assert list_checkpoints(config, open_store(config.object_store)) == []\n"
        "assert 'torch' not in sys.modules, 'listing imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)

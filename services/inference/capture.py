"""Inside the vLLM worker process: routed-expert capture and weight loading.

vLLM's native ``enable_return_routed_experts`` needs Model Runner V2, which needs
Triton, which has no CPU backend. This worker extension (``worker_extension_cls``)
does the same job on the V1 runner: vLLM's MoE routers accept a capture callback that
receives the exact expert ids each token was routed to (before any EPLB remapping),
and the runner's input batch says which rows of the step belong to which request at
which positions. Rows are scattered into a per-request table, indexed by token
position; the frontend takes a request's table (from the position it asks for) when
the request finishes.

Routes are kept with the KV blocks. Every row is also written beside its position's KV
slot: an array shaped like the KV cache's slots (``[num_blocks * block_size, layers,
top_k]``), written through the step's own slot mapping, in the same step that writes the
keys and values. A request that hits the
prefix cache starts with ``num_computed_tokens`` > 0 and its block table pointing at
cached blocks; its table is filled from those blocks' routes, which are the routes of
the forward that computed the KV it attends to. Prefix caching stays on (vLLM's native
capture keeps routes per block the same way, keyed by the block's hash). A block is
only hit when full, and a full block was written, rows and KV, by one request; blocks
written while capture was off are forgotten when it turns on (the engine resets the
prefix cache then).

Only tokens the engine actually runs get a row: the prompt, then every generated
token but the last (which is never fed back).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def _request_amx_permission() -> None:
    """Asks Linux for the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) in this process.

    vLLM's bf16 CPU attention runs AMX tile instructions on CPUs that have them, but
    nothing in the worker process asks for the permission first: Linux then answers the
    first tile instruction with SIGILL and the worker dies (seen on a Sapphire Rapids
    VM, where a float32 engine ran and a bfloat16 one died on its first request). The
    permission is per process and cleared by exec, so the worker asks for it itself:
    this module is imported there, as vLLM's ``worker_extension_cls``, before the model
    loads.
    """
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        log.warning("the CPU has AMX but Linux refused its tile state; bf16 may crash")


_request_amx_permission()


class RoutingCapture:
    """Mixed into vLLM's worker class; methods are called with ``collective_rpc``."""

    model_runner: Any
    vllm_config: Any

    def etude_capture_enable(self, enabled: bool, max_model_len: int) -> tuple[int, int]:
        """Binds (or unbinds) the capture callbacks; returns (moe layers, top_k). Forgets
        every table and every block's routes (the engine resets its prefix cache too)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runners = [
            module
            for module in self.model_runner.get_model().modules()
            if isinstance(module, MoERunner)
        ]
        if not runners or not all(isinstance(r.router, BaseRouter) for r in runners):
            raise RuntimeError("routed-expert capture needs vLLM MoE layers with a BaseRouter")
        layer_ids = sorted(r.layer_id for r in runners)
        self._etude_layer_index = {layer: index for index, layer in enumerate(layer_ids)}
        self._etude_top_k = int(runners[0].router.top_k)
        self._etude_max_len = max_model_len
        self._etude_tables: dict[str, np.ndarray] = {}
        self._etude_lengths: dict[str, int] = {}
        # Routes beside the KV slots: ~top_k / (2 x kv_heads x head_dim) of the KV memory.
        kv_cache = self.model_runner.kv_cache_config
        num_slots = kv_cache.num_blocks * max(
            int(kv_cache.kv_cache_groups[0].kv_cache_spec.block_size), self._etude_block_size()
        )
        self._etude_slots = np.full((num_slots, len(layer_ids), self._etude_top_k), -1, np.int16)
        self._etude_step: dict[str, Any] | None = None
        for runner in runners:
            runner.router.set_capture_fn(
                partial(self._etude_capture, runner.layer_id) if enabled else None
            )
        if enabled and not getattr(self, "_etude_wrapped", False):
            execute = self.model_runner.execute_model

            def execute_and_scatter(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                self._etude_step = {"scheduled": scheduler_output.num_scheduled_tokens, "rows": {}}
                try:
                    return execute(scheduler_output, *args, **kwargs)
                finally:
                    self._etude_scatter()

            self.model_runner.execute_model = execute_and_scatter
            self._etude_wrapped = True
        self._etude_enabled = enabled
        return len(layer_ids), self._etude_top_k

    def _etude_block_table(self) -> Any:
        # KV cache group 0: Qwen3-MoE has full attention only.
        return self.model_runner.input_batch.block_table[0]

    def _etude_block_size(self) -> int:
        return int(self._etude_block_table().block_size)

    def _etude_capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        step = self._etude_step
        if step is None:
            return  # a forward outside execute_model (warm-up, profiling)
        if "layout" not in step:
            batch = self.model_runner.input_batch
            count = batch.num_reqs
            blocks = self._etude_block_table()
            num_tokens = sum(step["scheduled"].values())
            step["layout"] = (
                list(batch.req_ids[:count]),
                batch.num_computed_tokens_cpu[:count].copy(),
                blocks.block_table.np[:count].copy(),
                int(blocks.block_size),
                # The KV slot of every scheduled token, as the attention writes them (the
                # CPU runner's device buffers are its host buffers).
                blocks.slot_mapping.cpu[:num_tokens].numpy().copy(),
            )
        step["rows"][self._etude_layer_index[layer_id]] = topk_ids.to("cpu", torch.int32)

    def _etude_scatter(self) -> None:
        step, self._etude_step = self._etude_step, None
        if not getattr(self, "_etude_enabled", False) or step is None or "layout" not in step:
            return
        req_ids, computed, block_rows, block_size, slots = step["layout"]
        layers = step["rows"]
        if len(layers) != len(self._etude_layer_index):
            log.warning(
                "routed-expert capture saw %d of %d MoE layers in a step",
                len(layers),
                len(self._etude_layer_index),
            )
            return
        rows = torch.stack([layers[i] for i in range(len(layers))], dim=1).numpy()  # [T, L, K]
        rows = rows.astype(np.int16)
        written = slots >= 0  # padding has no slot
        self._etude_slots[slots[written]] = rows[: len(slots)][written]
        offset = 0
        for req_id, start, blocks in zip(req_ids, computed, block_rows, strict=True):
            start, count = int(start), int(step["scheduled"].get(req_id, 0))
            table = self._etude_tables.get(req_id)
            if table is None:
                table = np.full(
                    (self._etude_max_len, rows.shape[1], rows.shape[2]), -1, dtype=np.int16
                )
                self._etude_tables[req_id] = table
                # Prompt positions served from the prefix cache: the routes kept with
                # their blocks, from the forward that computed them.
                self._etude_read_blocks(table, blocks, block_size, start)
            computed_rows = rows[offset : offset + count]
            table[start : start + count] = computed_rows
            self._etude_lengths[req_id] = max(self._etude_lengths.get(req_id, 0), start + count)
            offset += count

    def _etude_read_blocks(
        self, table: np.ndarray, blocks: np.ndarray, block_size: int, num_cached: int
    ) -> None:
        """Fills ``table``'s first ``num_cached`` rows from the routes kept beside the
        request's cached blocks' slots."""
        if num_cached:
            positions = np.arange(num_cached)
            slots = blocks[positions // block_size].astype(np.int64) * block_size
            table[:num_cached] = self._etude_slots[slots + positions % block_size]

    def etude_capture_take(
        self, requests: dict[str, tuple[int, int]], forget: list[str]
    ) -> dict[str, tuple[bytes, tuple[int, ...]]]:
        """Removes and returns the tables of ``requests`` (request id -> the first and
        one past the last position wanted), as (little-endian int16 bytes, shape) -- plain
        values survive the engine's RPC serialization -- and drops those of `forget`
        (finished requests nobody asked routing for). vLLM appends a suffix to request ids
        (``<id>-<hex>``); both match.

        Rows past the request's end are not its tokens': under speculative decoding, the
        draft tokens the last verification rejected (a rejected draft token's row is
        otherwise written again when its position runs with the token that stayed).
        """
        dropped = set(forget)
        taken: dict[str, tuple[bytes, tuple[int, ...]]] = {}
        for internal in list(self._etude_tables):
            base = internal.rsplit("-", 1)[0]
            key = internal if internal in requests or internal in dropped else base
            if key in requests:
                table = self._etude_tables.pop(internal)
                start, end = requests[key]
                stop = min(end, self._etude_lengths.pop(internal, 0))
                rows = table[min(start, stop) : stop]
                taken[key] = (rows.astype("<i2").tobytes(), rows.shape)
            elif key in dropped:
                del self._etude_tables[internal]
                self._etude_lengths.pop(internal, None)
        return taken

    def etude_load_weights(self, path: str) -> int:
        """Loads a full HF-named checkpoint from a safetensors file into the running model.

        vLLM's in-place reload, not ``model.load_weights``: kernels repack weights after
        loading (the CPU MoE kernels keep experts in their own layout), and the reload
        runs that post-processing again.
        """
        from safetensors.torch import load_file

        tensors = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()))
        self._etude_repack_cpu_experts()
        return len(tensors)

    def etude_load_draft_weights(self, path: str) -> int:
        """Loads the speculative draft's weights (a published version's MTP draft, under
        the draft's names) from a safetensors file into the running draft model.

        The draft's own layers go through vLLM's layerwise reload, as the target's do
        (``reload_weights``: on CPU its linear layers keep prepacked weights, which a
        plain copy into the parameters would not reach). The embedding and LM head it
        shares with the target are left out: they are the target's, reloaded with it.
        """
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        draft = getattr(getattr(self.model_runner, "drafter", None), "model", None)
        speculative = self.vllm_config.speculative_config
        if draft is None or speculative is None or speculative.draft_model_config is None:
            raise RuntimeError("this engine has no speculative draft model to load weights into")
        tensors = load_file(path)
        own = [module for name, module in draft.model.named_children() if name != "embed_tokens"]
        for module in own:
            initialize_layerwise_reload(module)
        loaded = draft.load_weights(iter(tensors.items()))
        for module in own:
            finalize_layerwise_reload(module, speculative.draft_model_config)
        return len(loaded)

    def _etude_repack_cpu_experts(self) -> None:
        """Packs the reloaded expert weights into the CPU MoE kernel's layout.

        vLLM's CPU experts keep ``w13``/``w2`` prepacked for their grouped GEMM, and
        pack them in ``fused_experts.process_weights_after_loading``. The in-place
        reload runs the MoE method's post-processing again but, for a kernel already
        set up (a weight update), skips that step: the experts then multiply by
        checkpoint-layout weights as if packed, and the served policy is garbage that
        matches neither version (found on the small preset; the tiny preset's outputs
        hid it). Packing them here makes a reloaded engine match one loaded from disk.
        """
        import torch

        if torch.cuda.is_available():
            return
        for module in self.model_runner.model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith("cpu_moe"):
                experts.process_weights_after_loading(module)

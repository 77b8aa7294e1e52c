"""``ZeroOffloadStrategy``: ZeRO-Offload (and ZeRO-2 across ranks) behind Lightning's unchanged Trainer loop.

Lightning glue only. The strategy builds an :class:`~lightning_zero_offload.engine.OffloadEngine`
from the optimizer that ``configure_optimizers`` returns, flushes gradient buckets after every
backward, and translates checkpoints (fp32 master weights, torch AdamW optimizer format). The step
itself is taken by :class:`~lightning_zero_offload.precision.ZeroOffloadPrecision`.

It is a ``ParallelStrategy`` launched like DDP (Lightning's own launchers, ranks and collectives),
but the module is never wrapped in ``DistributedDataParallel``: the engine reduce-scatters gradients
itself. With one process it behaves like a single-device strategy (no process group, and the
dataloader keeps its own sampler), so a one-GPU run matches ``strategy="auto"`` batch for batch.
"""

from __future__ import annotations

import atexit
import gc
import warnings
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_zero_offload.callbacks import OffloadMetrics
from lightning_zero_offload.checkpoint_io import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    all_gather_objects,
    load_checkpoint_with,
    save_full_checkpoint,
    warn_if_custom_io_sharded,
    writes_before_returning,
)
from lightning_zero_offload.engine import LossScalerConfig, OffloadEngine, OffloadOptions
from lightning_zero_offload.engine.checkpoint import FORMAT_KEY, save_sharded, sharded_layout
from lightning_zero_offload.engine.checks import check_real
from lightning_zero_offload.engine.collectives import abandon_process_group, broadcast_tensors_
from lightning_zero_offload.engine.model_checks import (
    check_param_dtypes,
    check_same_on_all_ranks,
    check_unique_params,
    describe_model,
)
from lightning_zero_offload.engine.state import buffers_shared_for_save
from lightning_zero_offload.planner import check_host_memory
from lightning_zero_offload.precision import ZeroOffloadPrecision


class ZeroOffloadStrategy(ParallelStrategy):
    """Low-precision params, forward and backward on the device; fp32 master weights and Adam on the CPU.

    Args:
        bucket_size_mb: size of a gradient bucket on the device. Gradients leave the device a bucket at a
            time during backward and at most about two buckets exist there; larger buckets mean fewer,
            more efficient transfers and collectives, smaller ones less device memory.
        pin_memory: page-lock the host staging buffers (CUDA only) so transfers are asynchronous and fast.
            Only bucket-sized buffers are pinned, never the master weights or the optimizer state.
        overlap: move and accumulate gradient buckets on a worker thread (and a side stream on CUDA) while
            backward continues, and publish bucket k while the CPU updates bucket k+1. ``False`` serialises
            everything. Default (None): on for an accelerator, off on a CPU device, where the worker would
            compete with backward for the same cores.
        cpu_threads: threads for the CPU Adam kernels. Default (None): on an accelerator the cores this
            process may use divided by the ranks on this node (``OMP_NUM_THREADS``, which torchrun sets to
            1, is not consulted); on a CPU device ``torch.get_num_threads()``. Capped at the usable cores.
        cpu_step: when the CPU optimizer step runs (docs/dpu.md). ``"sync"``: after backward, on the
            critical path. ``"speculative"``: each gradient bucket's step runs during backward, is validated
            after it (clipping, overflow) and corrected if needed; results equal ``"sync"``. ``"delayed"``:
            overlaps the next forward/backward, which sees one-step-stale weights (changes convergence).
            ``"auto"`` (default): ``"speculative"`` on an accelerator, ``"sync"`` on a CPU device.
        speculation_rollback: how ``cpu_step="speculative"`` takes a speculated bucket back when clipping
            triggers or a gradient overflows: ``"undo"`` inverts the Adam step algebraically (no extra memory;
            equal to sync within fp32 rounding), ``"snapshot"`` copies the bucket's state before speculating
            (bitwise equal to sync; 12 bytes of host memory per parameter). ``"auto"``: snapshot for fp16
            (overflows are routine there), undo otherwise.
        loss_scale_init: fp16 only: initial dynamic loss scale.
        loss_scale_growth_interval: fp16 only: overflow-free steps before the scale grows.
        loss_scale_growth_factor: fp16 only: factor by which the scale grows.
        loss_scale_backoff_factor: fp16 only: factor applied to the scale after ``loss_scale_hysteresis``
            overflowing steps (each overflowing step is skipped).
        loss_scale_hysteresis: fp16 only: overflows tolerated before the scale is lowered.
        loss_scale_min: fp16 only: the scale never goes below this.
        delayed_param_update: deprecated alias of ``cpu_step="delayed"``.
        dpu_warmup_steps: with ``cpu_step="delayed"``, synchronous steps before the delayed update starts.
        dpu_weight_prediction: with ``cpu_step="delayed"``, run forward/backward on
            ``W_{t-1} + (W_{t-1} - W_{t-2})`` (the update still running predicted as a repeat of the last one)
            instead of ``W_{t-1}``. Costs no memory or bandwidth; removed 37-63% of DPU's convergence loss on
            the demo (docs/dpu.md).
            Needs a low-precision device copy ("bf16-mixed" or "16-mixed").
        checkpoint_format: ``"full"``: one file with the full fp32 weights and optimizer state (rank 0 writes).
            ``"sharded"``: a directory, each rank writes its own shard; resumable at any world size.
        metrics: add the :class:`~lightning_zero_offload.callbacks.OffloadMetrics` callback (per-step time
            breakdown, gradient norm and loss scale as ``offload/*`` metrics, and a summary at the end of fit).
        max_consecutive_skipped_steps: raise :class:`~lightning_zero_offload.engine.failures.NonFiniteLossError`
            after this many optimizer steps in a row were skipped for inf/nan gradients (``None``: never). fp16
            also raises when a step overflows at ``loss_scale_min``. The default leaves room for fp16's loss
            scale to calibrate down from ``loss_scale_init`` (two skipped steps per halving).
        in_place_on_cpu: where nothing would be offloaded (a CPU device, ``"32-true"``, one process,
            ``cpu_step="sync"``), the parameters are the fp32 master weights and the step reads each gradient
            where backward left it: plain training's memory traffic, none of the offload path's copies.
            Default (None): exactly there. ``False``: always run the offload data path that an accelerator
            runs (on a CPU, its copies are real copies; useful to test it). ``True``: require it (an error
            says which condition is not met).
        process_group_backend: torch.distributed backend (default: nccl on CUDA, gloo on CPU).
        timeout: how long any collective (the engine's, checkpointing's and Lightning's own) may wait for the
            other ranks before it raises: a ``timedelta`` or seconds. Default: torch's 30 minutes. A rank that
            fails does not wait for it: its peers are released as soon as it fails (docs/reliability.md).
        start_method: how Lightning starts the processes (as in ``DDPStrategy``).
    """

    strategy_name = "zero_offload"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        bucket_size_mb: float = 25.0,
        pin_memory: bool = True,
        overlap: bool | None = None,
        cpu_threads: int | None = None,
        cpu_step: Literal["auto", "sync", "speculative", "delayed"] = "auto",
        speculation_rollback: Literal["auto", "undo", "snapshot"] = "auto",
        loss_scale_init: float = 2.0**16,
        loss_scale_growth_interval: int = 1000,
        loss_scale_growth_factor: float = 2.0,
        loss_scale_backoff_factor: float = 0.5,
        loss_scale_hysteresis: int = 2,
        loss_scale_min: float = 1.0,
        delayed_param_update: bool = False,
        dpu_warmup_steps: int = 40,
        dpu_weight_prediction: bool = False,
        checkpoint_format: Literal["full", "sharded"] = "full",
        metrics: bool = True,
        max_consecutive_skipped_steps: int | None = 20,
        in_place_on_cpu: bool | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        self.options = OffloadOptions(
            bucket_size_mb=bucket_size_mb,
            pin_memory=pin_memory,
            overlap=overlap,
            cpu_threads=cpu_threads,
            loss_scaler=LossScalerConfig(
                init_scale=loss_scale_init,
                growth_factor=loss_scale_growth_factor,
                backoff_factor=loss_scale_backoff_factor,
                growth_interval=loss_scale_growth_interval,
                hysteresis=loss_scale_hysteresis,
                min_scale=loss_scale_min,
            ),
            cpu_step=cpu_step,
            speculation_rollback=speculation_rollback,
            delayed_param_update=delayed_param_update,
            dpu_warmup_steps=dpu_warmup_steps,
            dpu_weight_prediction=dpu_weight_prediction,
            checkpoint_format=checkpoint_format,
            max_consecutive_skipped_steps=max_consecutive_skipped_steps,
            in_place_on_cpu=in_place_on_cpu,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = collective_timeout(timeout)
        self._start_method = start_method
        self.metrics = metrics
        self.engine: OffloadEngine | None = None
        self._param_keys: list[list[str]] = []
        self._preflight_error: MemoryError | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="ZeRO-Offload: fp32 master weights and Adam on the CPU, low-precision training on the device",
            override=True,
        )

    # Lightning builds a generic precision plugin from `precision=` and assigns it here; the offload step
    # needs its own, so any plugin given is translated (and unsupported precisions are refused).
    @property  # type: ignore[override]
    def precision_plugin(self) -> ZeroOffloadPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroOffloadPrecision("32-true")
        return self._precision_plugin  # type: ignore[return-value]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and not isinstance(plugin, ZeroOffloadPrecision):
            plugin = ZeroOffloadPrecision(str(plugin.precision))
        self._precision_plugin = plugin

    # -- processes and ranks (as DDPStrategy, minus the DDP wrapper) ------------------------------

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """More than one rank: Lightning then adds a DistributedSampler to the dataloaders."""
        return self.num_nodes * self.num_processes > 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        if not self.is_distributed:
            return  # one process needs no process group (no free port, no NCCL init)
        reset_seed()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        if not dist.is_initialized():
            _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
            # Lightning does this for NCCL only; a gloo group left to interpreter teardown can abort the
            # process at exit ("terminate called without an active exception").
            atexit.register(_release_process_group)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        dist.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        module = self.lightning_module
        assert module is not None
        if trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync:
                raise ValueError("zero_offload does not support sync_batchnorm=True")
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"zero_offload takes exactly one optimizer, configure_optimizers returned {len(self.optimizers)}. "
                    "Put the parameters in param groups of one optimizer instead."
                )
            self._check_model(module)
            try:
                check_host_memory(
                    module,
                    self.options,
                    self.precision_plugin.param_dtype,
                    self.world_size,
                    self.num_processes,
                    self.root_device,
                )
            except MemoryError as error:
                self._preflight_error = error  # teardown must not replace it (see teardown)
                raise
            if self.is_distributed:
                broadcast_tensors_(list(module.state_dict().values()), None, self.root_device)
            self.engine = OffloadEngine(
                self.optimizers[0],
                self.root_device,
                self.precision_plugin.param_dtype,
                self.options,
                # None means the default group to torch.distributed; holding the group object itself
                # would keep it alive past destroy_process_group (see _release_process_group).
                process_group=None,
                local_world_size=self.num_processes,
            )
            self._param_keys = _state_dict_keys(module, self.engine.params)
            self.precision_plugin.attach(self.engine)
            _refuse_weight_averaging_with_delayed(trainer, self.engine.cpu_step)
            if self.metrics and not any(isinstance(c, OffloadMetrics) for c in trainer.callbacks):
                trainer.callbacks.append(OffloadMetrics())
        self.model_to_device()
        self.setup_precision_plugin()

    def _check_model(self, module: LightningModule) -> None:
        """Refuse what the engine would train wrongly, and models or options that differ between ranks
        (before the first collective that depends on them)."""
        optimizer = self.optimizers[0]
        names: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        check_unique_params(optimizer, names)
        trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        check_param_dtypes(trainable, names, self.precision_plugin.param_dtype)
        if self.is_distributed:
            description = describe_model(module, optimizer, self.options, self.precision_plugin.precision)
            check_same_on_all_ranks(description, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: release the engine and the process group without a collective.

        The other ranks may be blocked in a collective or already gone, so gathering anything now would
        hang. Tearing the process group down makes their pending collectives fail at once, so every rank
        exits within seconds instead of at the collective timeout.
        """
        # The group goes first: aborting NCCL also ends device work still waiting for a peer, which the
        # engine's workers may be waiting for. Never raise from here: Lightning would report this error
        # instead of the rank's real one.
        releases = ([abandon_process_group] if self.is_distributed else []) + [self._close_engine_after_failure]
        for release in releases:
            try:
                release()
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"zero_offload: cleaning up after the failure also failed: {error!r}", stacklevel=2)

    def _close_engine_after_failure(self) -> None:
        if self.engine is not None:
            self.engine.close(after_failure=True)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.begin_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.engine is not None:
            self.engine.finish_backward()

    def _sync_engine(self) -> None:
        if self.engine is not None and not self.engine.closed:
            self.engine.sync()  # evaluation sees fully updated parameters, also with a delayed update

    @override
    def on_validation_start(self) -> None:
        self._sync_engine()

    @override
    def on_test_start(self) -> None:
        self._sync_engine()

    @override
    def on_predict_start(self) -> None:
        self._sync_engine()

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the master weights and moments live in the engine, which setup() creates

    @property
    def _sharded(self) -> bool:
        return self.options.checkpoint_format == "sharded" and self.engine is not None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 master weights in place of the device copies.

        Sharded: the trainable weights are left out here; each rank writes its shard of them instead.
        """
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        if self.engine is None or self.engine.closed:
            return state  # after fit the module itself holds the master weights
        if self._sharded:
            for keys in self._param_keys:
                for key in keys:
                    state.pop(key, None)
            return state
        # Lightning calls this to save: views of the engine's buffers (as a plain module's state_dict
        # holds its live parameters), not a second copy, when the writer is done when it returns.
        with buffers_shared_for_save(self.engine, writes_before_returning(self.checkpoint_io)):
            weights = self.engine.master_params()
        for keys, weight in zip(self._param_keys, weights):
            for key in keys:
                state[key] = weight
        return state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_state(optimizer)
        if self._sharded:
            return {"state": {}, "param_groups": self.engine.param_groups_state()}
        with buffers_shared_for_save(self.engine, writes_before_returning(self.checkpoint_io)):
            return self.engine.optimizer_state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Full: rank 0 writes one file. Sharded: every rank writes its shard into a new version directory.

        Either way the new checkpoint is complete before it replaces an existing one (docs/checkpoints.md).
        """
        if self._sharded:
            self._save_sharded(checkpoint, filepath)
        elif self.is_global_zero:
            save_full_checkpoint(self.checkpoint_io, checkpoint, filepath, storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        assert self.engine is not None
        warn_if_custom_io_sharded(self.checkpoint_io)
        if self.is_global_zero:
            checkpoint[FORMAT_KEY] = sharded_layout(self.engine, self._param_keys)
        save_sharded(
            filepath,
            self.engine.shard_state_dict(),
            checkpoint if self.is_global_zero else None,
            self.global_rank,
            broadcast=self.broadcast,
            gather=all_gather_objects,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any filesystem; ``weights_only`` as passed to ``fit`` (Lightning 2.4+ alike)."""
        if weights_only is None:
            weights_only = getattr(self, "_weights_only", None)
        return load_checkpoint_with(self.checkpoint_io, checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.engine is not None and not self.engine.closed:
            state = checkpoint["state_dict"]
            missing = [keys[0] for keys in self._param_keys if keys[0] not in state]
            if missing and strict:
                raise KeyError(f"The checkpoint has no weights for {missing[:5]}")
            current = self.engine.master_params() if missing else None
            self.engine.load_master_params(
                [state[keys[0]] if keys[0] in state else current[i] for i, keys in enumerate(self._param_keys)]
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if self.engine is None or self.engine.closed:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise ValueError(f"expected one optimizer state in the checkpoint, found {len(states)}")
        self.engine.load_optimizer_state_dict(states[0])

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            # Hand the module back holding the trained fp32 master weights; the CPU optimizer state stays
            # with the closed engine so `trainer.save_checkpoint` after fit still saves it.
            self.engine.close()
        try:
            super().teardown()
        except Exception:
            # A refused pre-flight is what the user must fix; a module that cannot move back (one on the
            # meta device: "Cannot copy out of meta tensor") must not take its place.
            if self._preflight_error is None:
                raise
            raise self._preflight_error from None


try:  # WeightAveraging is newer than the oldest Lightning this package supports
    from lightning.pytorch.callbacks import WeightAveraging

    _AVERAGING: tuple[type, ...] = (WeightAveraging, StochasticWeightAveraging)
except ImportError:
    _AVERAGING = (StochasticWeightAveraging,)


def _refuse_weight_averaging_with_delayed(trainer: Trainer, cpu_step: str) -> None:
    """Weight averaging writes the parameters, which the delayed update refuses: say so before training."""
    averaging = [c for c in trainer.callbacks if isinstance(c, _AVERAGING)]
    if averaging and cpu_step == "delayed":
        raise ValueError(
            f"{type(averaging[0]).__name__} writes the averaged weights into the parameters, and cpu_step='delayed' "
            "cannot merge writes to parameters (the device is one step behind the master weights). Use "
            "cpu_step='sync' or 'speculative' with weight averaging."
        )


def _release_process_group() -> None:
    """Destroy the process group, then collect garbage while the interpreter is fully alive.

    A gloo group still referenced from a reference cycle (Lightning's trainer, strategy and module form
    many) would otherwise be destroyed during interpreter finalization, which aborts the process in
    about one exit of four (measured with two ranks).
    """
    _destroy_dist_connection()
    gc.collect()


# About 31 years. timedelta itself ends near 8.6e13 s, but torch's C++ side counts in int64 micro- or
# nanoseconds and overflows long before that (gloo refuses timedelta.max as a negative timeout).
MAX_TIMEOUT_S = 1e9


def collective_timeout(timeout: timedelta | float | None) -> timedelta | None:
    """The ``timeout`` option as a timedelta (numbers are seconds, for config files), validated.

    Both front ends (Trainer and Fabric strategies) take the same types: a timedelta, seconds as an int
    or float, or None (torch's default).
    """
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    check_real(
        "timeout",
        seconds,
        f"of seconds in (0, {MAX_TIMEOUT_S:.0e}] (about 31 years), or a datetime.timedelta in that range",
        lambda s: 0 < s <= MAX_TIMEOUT_S,
    )
    return timedelta(seconds=seconds)


def _state_dict_keys(module: LightningModule, params: list[torch.nn.Parameter]) -> list[list[str]]:
    """For each trainable parameter, every state-dict key it appears under (tied weights appear twice)."""
    keys: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        keys.setdefault(id(p), []).append(name)
    missing = [i for i, p in enumerate(params) if id(p) not in keys]
    if missing:
        raise ValueError(
            "The optimizer holds parameters that are not parameters of the LightningModule; "
            "build the optimizer from self.parameters() in configure_optimizers"
        )
    return [keys[id(p)] for p in params]

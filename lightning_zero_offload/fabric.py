"""``L.Fabric(strategy="zero_offload")``: the offload engine behind Lightning Fabric's own loop API.

Fabric glue only; the engine is the Trainer strategy's. ``fabric.setup(model, optimizer)`` builds an
:class:`~lightning_zero_offload.engine.OffloadEngine` from the optimizer (the trainable parameters
go to the device as low-precision views, never as fp32), ``fabric.backward`` streams gradients to
the CPU, and the optimizer Fabric hands back takes the step on the CPU. Launching, ranks and
collectives are Fabric's DDP machinery, without the ``DistributedDataParallel`` wrapper: the engine
reduce-scatters gradients itself.

Checkpoints have the formats of the Trainer strategy: one file (``checkpoint_format="full"``, rank 0
writes the full fp32 weights and a torch AdamW optimizer state) or a sharded directory that resumes at
any world size. Both load with ``torch.load(weights_only=True)``; a full file loads into plain Fabric
with ``torch.optim.AdamW``, and :func:`~lightning_zero_offload.convert_checkpoint_to_fp32_state_dict`
exports either to a plain fp32 ``state_dict``.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.types import _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_zero_offload.checkpoint_io import all_gather_objects
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.checkpoint import (
    FABRIC_KEY,
    FORMAT_KEY,
    atomic_save,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
    sharded_layout,
)
from lightning_zero_offload.engine.collectives import broadcast_tensors_
from lightning_zero_offload.engine.model_checks import (
    check_param_dtypes,
    check_same_on_all_ranks,
    check_unique_params,
    describe_model,
)
from lightning_zero_offload.engine.state import buffers_shared_for_save
from lightning_zero_offload.mixed_precision import forward_context
from lightning_zero_offload.planner import check_host_memory
from lightning_zero_offload.precision import ENGINE_STATE_KEY, resolve_precision
from lightning_zero_offload.strategy import ZeroOffloadStrategy as _TrainerStrategy
from lightning_zero_offload.strategy import _release_process_group, _state_dict_keys, collective_timeout


class ZeroOffloadFabricPrecision(Precision):
    """``"bf16-mixed"``/``"16-mixed"``: low-precision weights on the device, the forward under autocast with
    the rule of :mod:`lightning_zero_offload.mixed_precision`; ``"32-true"``: fp32. Inputs and outputs are
    converted as by Fabric's ``MixedPrecision`` (floating point to fp32)."""

    def __init__(self, precision: str = "bf16-mixed") -> None:
        self.precision, self.param_dtype = resolve_precision(precision)  # type: ignore[assignment]
        self.device_type = "cpu"  # set by the strategy once the device is known
        self.engine: OffloadEngine | None = None

    @override
    def forward_context(self) -> AbstractContextManager:
        if torch.is_grad_enabled() and self.engine is not None and not self.engine.closed:
            self.engine.replan_if_changed()  # a training forward: unfrozen parameters / added groups
        return forward_context(self.device_type, self.param_dtype)

    @override
    def convert_input(self, data: Any) -> Any:
        return _to_float32(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return _to_float32(data)

    @override
    def backward(self, tensor: Tensor, model: Module | None, *args: Any, **kwargs: Any) -> None:
        if self.engine is not None:
            tensor = self.engine.scale_loss(tensor)  # fp16: dynamic loss scale, unscaled in the CPU kernel
        tensor.backward(*args, **kwargs)


def _to_float32(data: Any) -> Any:
    def convert(t: Tensor) -> Tensor:
        return t.float() if torch.is_floating_point(t) else t

    return apply_to_collection(data, Tensor, convert)


class ZeroOffloadFabricStrategy(DDPStrategy):
    """ZeRO-Offload (and ZeRO-2 across ranks) for Lightning Fabric.

    Args:
        offload_options: the offload options of :class:`~lightning_zero_offload.ZeroOffloadStrategy`
            (``bucket_size_mb``, ``pin_memory``, ``overlap``, ``cpu_threads``, ``cpu_step``, ``loss_scale_*``,
            ``dpu_*``, ``checkpoint_format``, ...), with the same defaults and checks.
        process_group_backend, start_method: as in Fabric's ``DDPStrategy``.
        timeout: as in :class:`~lightning_zero_offload.ZeroOffloadStrategy`: a ``timedelta`` or seconds.
    """

    strategy_name = "zero_offload"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **offload_options: Any,
    ) -> None:
        if "metrics" in offload_options:
            raise TypeError("metrics= is a Trainer option (a callback); Fabric has no callbacks to add it to")
        if "precision_plugin" in offload_options:
            raise TypeError("pass precision=ZeroOffloadFabricPrecision(...) (Fabric's name), not precision_plugin=")
        # The Trainer strategy owns the option names, defaults and validation; build them the same way.
        self.options = _TrainerStrategy(**offload_options).options
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=collective_timeout(timeout),  # the Trainer strategy's types and range
            start_method=start_method,
        )
        self._backward_sync_control = None  # gradients accumulate on the CPU; there is no sync to skip
        self.engine: OffloadEngine | None = None
        self._module: Module | None = None
        self._param_keys: list[list[str]] = []
        self._clip_norm: float | None = None
        self._clip_value: float | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="ZeRO-Offload: fp32 master weights and Adam on the CPU, low-precision training on the device",
            override=True,
        )

    # Fabric builds a generic precision plugin from `precision=` and assigns it here; translate it.
    @property  # type: ignore[override]
    def precision(self) -> ZeroOffloadFabricPrecision:
        if self._precision is None:
            self._precision = ZeroOffloadFabricPrecision("32-true")
        return self._precision  # type: ignore[return-value]

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        if precision is not None and not isinstance(precision, ZeroOffloadFabricPrecision):
            precision = ZeroOffloadFabricPrecision(str(precision.precision))
        self._precision = precision

    @property
    def _distributed(self) -> bool:
        return self.num_nodes * self.num_processes > 1

    @override
    def setup_environment(self) -> None:
        if self._distributed:
            super().setup_environment()  # DDP's process group
            atexit.register(_release_process_group)  # see strategy._release_process_group
        else:  # one process needs no process group (no free port, no init)
            self.accelerator.setup_device(self.root_device)

    # -- setup -----------------------------------------------------------------------------------

    @override
    def module_to_device(self, module: Module) -> None:
        """Before setup, only what the engine will not own moves: the trainable fp32 weights would
        otherwise pass through device memory at 4 bytes per parameter."""
        if self.engine is not None or not any(p.requires_grad for p in module.parameters()):
            module.to(self.root_device)
            return
        with torch.no_grad():
            for p in module.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(self.root_device)
            for sub in module.modules():
                for name, buffer in sub._buffers.items():
                    if buffer is not None:
                        sub._buffers[name] = buffer.to(self.root_device)

    @override
    def setup_module(self, module: Module) -> Module:
        module.to(self.root_device)  # no optimizer: evaluation only, the module keeps its dtype
        return module

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        if len(optimizers) != 1:
            raise ValueError(
                f"zero_offload takes exactly one optimizer, fabric.setup got {len(optimizers)}. "
                "Put the parameters in param groups of one optimizer instead."
            )
        if self.engine is not None:
            raise RuntimeError("zero_offload sets up one model and optimizer per Fabric; create a new Fabric")
        self.precision.device_type = self.root_device.type
        self._check_model(module, optimizers[0])
        check_host_memory(
            module, self.options, self.precision.param_dtype, self.world_size, self.num_processes, self.root_device
        )
        if self._distributed:
            broadcast_tensors_(list(module.state_dict().values()), None, self.root_device)
        self.engine = OffloadEngine(
            optimizers[0],
            self.root_device,
            self.precision.param_dtype,
            self.options,
            process_group=None,  # the default group (see ZeroOffloadStrategy.setup)
            local_world_size=self.num_processes,
        )
        self.precision.engine = self.engine
        self._module = module
        self._param_keys = _state_dict_keys(module, self.engine.params)
        module.to(self.root_device)  # what the engine does not own (frozen parameters, buffers)
        return module, [_OffloadedOptimizer(optimizers[0], self)], scheduler

    def _check_model(self, module: Module, optimizer: Optimizer) -> None:
        """The Trainer strategy's checks: what the engine would train wrongly, and setups that differ between
        ranks (before the first collective that depends on them)."""
        names: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), name)
        check_unique_params(optimizer, names)
        trainable = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        check_param_dtypes(trainable, names, self.precision.param_dtype)
        if self._distributed:
            description = describe_model(module, optimizer, self.options, self.precision.precision)
            check_same_on_all_ranks(description, self.root_device)

    # -- training --------------------------------------------------------------------------------

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        engine = self._engine()
        engine.begin_backward()
        self.precision.backward(tensor, module, *args, **kwargs)
        engine.finish_backward()

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise ValueError("zero_offload's optimizer.step() takes no closure: call fabric.backward before step()")
        clip_norm, clip_value = self._clip_norm, self._clip_value
        self._clip_norm = self._clip_value = None
        return self._engine().step(clip_norm=clip_norm, clip_value=clip_value)

    def zero_grad(self) -> None:
        """Drop the gradients accumulated on the CPU since the last step (``optimizer.zero_grad()``)."""
        if self.engine is None or self.engine.closed:
            return
        self.engine.finish_backward()
        self.engine.grads.new_window()
        self._clip_norm = self._clip_value = None

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Record the clip (applied on the CPU, fused into the step) and return the total gradient norm."""
        if float(norm_type) != 2.0:
            raise ValueError(f"zero_offload clips by the 2-norm only, got norm_type={norm_type}")
        engine = self._engine()
        engine.finish_backward()
        sumsq, overflow, _ = engine._global_grad_summary()
        norm = float("inf") if overflow else sumsq**0.5 / engine.loss_scale
        # With fp16 loss scaling an overflow is expected: the step is skipped and the scale lowered.
        if error_if_nonfinite and overflow and engine.scaler is None:
            raise RuntimeError(
                "The total norm of the gradients is non-finite, so it cannot be clipped. "
                "Pass error_if_nonfinite=False to fabric.clip_gradients to skip this step instead."
            )
        self._clip_norm = float(max_norm)
        return torch.tensor(norm)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._engine()
        self._clip_value = float(clip_val)

    def _engine(self) -> OffloadEngine:
        if self.engine is None or self.engine.closed:
            raise RuntimeError("zero_offload trains after fabric.setup(model, optimizer): no optimizer was set up")
        return self.engine

    # -- checkpoints -----------------------------------------------------------------------------

    @property
    def _sharded(self) -> bool:
        return self.options.checkpoint_format == "sharded" and self.engine is not None

    def _owns(self, obj: Any) -> bool:
        return self.engine is not None and obj is self._module

    def master_state_dict(self, module: Module) -> dict[str, Any]:
        """``module.state_dict()`` with the fp32 master weights in place of the low-precision device copies.

        A collective when several ranks train: call it on every rank.
        """
        state = module.state_dict()
        if self._owns(module) and not self.engine.closed:
            for keys, weight in zip(self._param_keys, self.engine.master_params()):
                for key in keys:
                    state[key] = weight
        return state

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The fp32 master state dict; sharded: without the trainable weights (each rank writes its shard)."""
        if not (self._sharded and self._owns(module)):
            return self.master_state_dict(module)
        state = module.state_dict()
        for key in (key for keys in self._param_keys for key in keys):
            state.pop(key, None)
        return state

    @override
    def get_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not isinstance(optimizer, _OffloadedOptimizer):
            return super().get_optimizer_state(optimizer)
        engine = self._engine()
        if self._sharded:
            state = {"state": {}, "param_groups": engine.param_groups_state()}
        else:
            state = engine.optimizer_state_dict()
        # Fabric checkpoints have no place of their own for it: the engine's state (step count, loss scaler,
        # pending schedule state) travels with the optimizer's, under the Trainer checkpoint's key.
        state[ENGINE_STATE_KEY] = engine.state_dict()
        return state

    @override
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Full: rank 0 writes one file. Sharded: a directory; every rank writes its shard of the master
        weights and moments. Either is complete on disk before it replaces an existing checkpoint."""
        keys = {
            "model": next((k for k, v in state.items() if self._owns(v)), None),
            "optimizer": next((k for k, v in state.items() if isinstance(v, _OffloadedOptimizer)), None),
        }
        # Views of the engine's buffers rather than a second copy of the fp32 state, when the writer is
        # the strategy's own (done when it returns; a user's CheckpointIO may write in the background).
        share = storage_options is None and type(self.checkpoint_io) is TorchCheckpointIO
        with buffers_shared_for_save(self.engine, share) if self.engine is not None else nullcontext():
            checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if keys["model"] is not None:
            checkpoint[FABRIC_KEY] = keys  # where the weights are, for the fp32 export and sharded loading
        if self._sharded and keys["model"] is not None:
            self._save_sharded(checkpoint, keys, Path(path))
        elif self.is_global_zero:
            if storage_options is None and type(self.checkpoint_io) is TorchCheckpointIO:
                atomic_save(checkpoint, path)
            else:  # a custom CheckpointIO (e.g. remote storage) decides how to write
                self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _save_sharded(self, checkpoint: dict[str, Any], keys: dict[str, str | None], path: Path) -> None:
        assert self.engine is not None
        # meta.pt in the Trainer's layout, so that load_sharded and the fp32 export read it unchanged
        checkpoint["state_dict"] = checkpoint.pop(keys["model"])
        if keys["optimizer"] is not None:
            checkpoint["optimizer_states"] = [checkpoint.pop(keys["optimizer"])]
        if self.is_global_zero:
            checkpoint[FORMAT_KEY] = sharded_layout(self.engine, self._param_keys)
        meta = checkpoint if self.is_global_zero else None
        save_sharded(path, self.engine.shard_state_dict(), meta, self.global_rank, self.broadcast, all_gather_objects)

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """As Fabric's, for both formats; the sharded one is reassembled at this world size."""
        if is_sharded_checkpoint(path):
            checkpoint = load_sharded(path, with_optimizer=_wants_optimizer(state))
            keys = checkpoint.pop(FABRIC_KEY)
            checkpoint.pop(FORMAT_KEY)
            checkpoint[keys["model"]] = checkpoint.pop("state_dict")
            if keys["optimizer"] is not None:
                checkpoint[keys["optimizer"]] = checkpoint.pop("optimizer_states")[0]
        else:
            checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            checkpoint.pop(FABRIC_KEY, None)
        if not state:
            return checkpoint
        if isinstance(state, Module):
            self.load_module_state_dict(state, checkpoint, strict=strict)
            return {}
        if isinstance(state, Optimizer):
            state.load_state_dict(checkpoint)
            return {}
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        # the weights before the optimizer: a pending delayed update restores device params over them
        names = sorted((name for name in state if name in checkpoint), key=lambda n: not isinstance(state[n], Module))
        for name in names:
            obj = state[name]
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict=strict)
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return checkpoint

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        module.load_state_dict(state_dict, strict=strict)
        if self._owns(module) and not self.engine.closed:
            missing = [keys[0] for keys in self._param_keys if keys[0] not in state_dict]
            current = self.engine.master_params() if missing else None
            self.engine.load_master_params(
                [state_dict[k[0]] if k[0] in state_dict else current[i] for i, k in enumerate(self._param_keys)]
            )

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()  # the module gets the trained fp32 master weights back
        super().teardown()


def _wants_optimizer(state: Any) -> bool:
    return not isinstance(state, Module) and (
        not isinstance(state, dict) or any(isinstance(v, Optimizer) for v in state.values())
    )


class _OffloadedOptimizer:
    """The user's optimizer, driven by the engine: ``step``, ``zero_grad`` and its state go through it.

    Imitates the wrapped optimizer's class (as Fabric's own wrapper does), so ``isinstance`` checks and
    LR schedulers work; ``param_groups`` are the wrapped optimizer's, which the engine reads live.
    """

    def __init__(self, optimizer: Optimizer, strategy: ZeroOffloadFabricStrategy) -> None:
        self._optimizer = optimizer
        self._strategy = strategy
        self.__class__ = type(
            "ZeroOffload" + optimizer.__class__.__name__, (_OffloadedOptimizer, optimizer.__class__), {}
        )

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self._strategy.optimizer_step(self, closure=closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._strategy.zero_grad()
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._strategy.get_optimizer_state(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine = self._strategy._engine()
        engine.load_optimizer_state_dict(state_dict)
        if ENGINE_STATE_KEY in state_dict:
            engine.load_state_dict(state_dict[ENGINE_STATE_KEY])

    def __getattr__(self, item: str) -> Any:
        if item == "_optimizer":  # not set yet (copy/unpickle): do not recurse
            raise AttributeError(item)
        return getattr(self._optimizer, item)


ZeroOffloadStrategy = ZeroOffloadFabricStrategy  # `from lightning_zero_offload.fabric import ZeroOffloadStrategy`
ZeroOffloadPrecision = ZeroOffloadFabricPrecision

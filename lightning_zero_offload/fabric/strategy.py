"""``L.Fabric(strategy="zero_offload")``: the offload engine behind Lightning Fabric's own loop API.

Fabric glue only: Fabric's hooks as calls on an :class:`~lightning_zero_offload.core.OffloadSession`, the
core the Trainer strategy shares. ``fabric.setup(model, optimizer)`` starts it, or the two-call form
``fabric.setup_module(model)`` then ``fabric.setup_optimizers(optimizer)`` (at the second call, once both are
known), and hands back an :class:`~lightning_zero_offload.core.OffloadedOptimizer`, whose ``step()`` runs on
the CPU. Methods that take a module take the ``_FabricModule`` that Fabric returned as well as the module
itself. Processes and ranks: :mod:`lightning_zero_offload.fabric.ranks`. Checkpoints have the Trainer
strategy's two formats. A loop announces the step that follows a backward with ``strategy.expect_step()``
and reads what the step did from ``strategy.last_step_stats`` (:class:`~lightning_zero_offload.core.SessionStrategy`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Literal
from weakref import WeakKeyDictionary

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.wrappers import _unwrap_objects
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_zero_offload.checkpoints import FABRIC_KEY, FORMAT_KEY
from lightning_zero_offload.core import (
    OPTIONS_DOC,
    BlockwiseInit,
    OffloadedOptimizer,
    OffloadSession,
    ParamOffloadSession,
    SessionStrategy,
    built_on_meta,
    coerced_precision,
    collective_timeout,
    make_offload_options,
    materialize,
    move_untrained_to,
    on_meta,
    training_session,
)
from lightning_zero_offload.core.checkpoint_io import load_checkpoint, save_checkpoint, uses_own_writer
from lightning_zero_offload.fabric.checkpoints import (
    fabric_checkpoint_from_sharded,
    loads_in_place,
    refuse_sharded_filter,
    restore_objects,
    sharded_from_fabric_checkpoint,
)
from lightning_zero_offload.fabric.precision import ZeroOffloadFabricPrecision
from lightning_zero_offload.fabric.ranks import DDPWithoutWrapper


class ZeroOffloadFabricStrategy(SessionStrategy, DDPWithoutWrapper):
    __doc__ = f"""ZeRO-Offload (and ZeRO-2 across ranks) for Lightning Fabric.

    Args:
        precision: Fabric's name for the precision plugin (``ZeroOffloadFabricPrecision``).
        offload_options: the offload options as keywords, with the names, defaults and checks of
            :class:`~lightning_zero_offload.ZeroOffloadStrategy` (but ``metrics``, a Trainer callback):
{OPTIONS_DOC}    """

    def __init__(  # keywords only, as its offload options
        self,
        *,
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
        self.options = make_offload_options(**offload_options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=collective_timeout(timeout),
            start_method=start_method,
        )
        self.needs_process_group = self.options.offload_params
        self.session: OffloadSession | ParamOffloadSession | None = None
        # Modules from setup_module, until setup_optimizer starts the engine with one; weak, as evaluation-only
        # modules may never get an optimizer. Each with its forward pre-hook that moves it for evaluation.
        self._awaiting_optimizer: WeakKeyDictionary[Module, RemovableHandle | None] = WeakKeyDictionary()
        # Those built on the meta device: their placeholders, for the engine to fill (OffloadSession.placeholders).
        self._placeholders: WeakKeyDictionary[Module, BlockwiseInit] = WeakKeyDictionary()
        self._load_hooks: WeakKeyDictionary[Module, RemovableHandle] = WeakKeyDictionary()  # theirs, until then

    # Fabric assigns a generic plugin built from `precision=`; the offload forward and backward need this one.
    precision = coerced_precision(ZeroOffloadFabricPrecision, "_precision")  # type: ignore[assignment]

    # -- setup -----------------------------------------------------------------------------------

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)`` builds on the meta device: ``setup`` materializes the model
        unit by unit, into its shards with parameters offloaded, else into the engine's master weights (never
        whole on the host or the device). Without it, with parameters offloaded, the model is built on the host,
        never on the device."""
        if not self.options.offload_params and not empty_init:
            return super().module_init_context(empty_init)
        stack = ExitStack()
        if empty_init:  # a load into the model before setup materializes it first (core/meta_device.py)
            stack.enter_context(built_on_meta())
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def module_to_device(self, module: Module) -> None:
        """Before setup, only what the engine will not own moves: the trainable fp32 weights would
        otherwise pass through device memory at 4 bytes per parameter."""
        if self.options.offload_params or on_meta(module, partly=True):
            return  # FSDP2, or the engine's blockwise fill, puts the buffers on the device (setup)
        if self.session is not None or not any(p.requires_grad for p in module.parameters()):
            module.to(self.root_device)
        else:
            move_untrained_to(module, self.root_device)

    @override
    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[Module, list[Optimizer], Any | None]:
        if self.session is not None:
            raise RuntimeError("zero_offload sets up one model and optimizer per Fabric; create a new Fabric")
        if self.options.offload_params:
            self._shard(module, optimizers)
        return module, [self._start_session(module, optimizers)], scheduler  # type: ignore[list-item]

    def _shard(self, module: Module, optimizers: Sequence[Optimizer] = ()) -> None:
        world = self.num_nodes * self.num_processes
        ParamOffloadSession.shard(
            module, self.root_device, self.precision.precision, self.options, world, self.num_processes, optimizers
        )

    @override
    def setup_module(self, module: Module) -> Module:
        """``fabric.setup_module(model)`` or ``fabric.setup(model)``: no optimizer yet. Its trainable weights stay
        on the host (``module_to_device`` moved the rest) for ``fabric.setup_optimizers`` to start the engine
        with; a forward before that, evaluation, first moves them to the device as they are."""
        if self.session is not None:  # beside the model being trained: evaluation only
            materialize(module, self.root_device)  # built on the meta device: whole, on the device
            module.to(self.root_device)
            return module
        if self.options.offload_params:
            if module not in self._awaiting_optimizer:
                self._shard(module)  # before the optimizer is built: it takes the sharded parameters
                self._awaiting_optimizer[module] = None
            return module
        # Built on the meta device: placeholders for the optimizer's build (the engine fills them).
        placeholders = on_meta(module, partly=True) and module not in self._awaiting_optimizer
        if placeholders and (blockwise := OffloadSession.placeholders(module, self.root_device)) is not None:
            self._placeholders[module] = blockwise
            strategy = weakref.ref(self)  # the hook must not keep the strategy (and its engine) alive

            def give_memory_to_load_into(module: Module, *args: Any) -> None:  # fabric.load_raw before the optimizer
                if (alive := strategy()) is not None:
                    alive._give_memory(module, torch.device("cpu"))

            self._load_hooks[module] = module.register_load_state_dict_pre_hook(give_memory_to_load_into)
        if module not in self._awaiting_optimizer:

            def move_for_evaluation(module: Module, args: Any) -> None:
                self._give_memory(module, self.root_device)
                module.to(self.root_device)
                if (hook := self._awaiting_optimizer.get(module)) is not None:  # None: a deep copy of the module
                    hook.remove()  # the module stays awaiting: setup_optimizers may still follow

            # A closure, not a bound method: copy.deepcopy(model) would otherwise copy the strategy too.
            self._awaiting_optimizer[module] = module.register_forward_pre_hook(move_for_evaluation)
        return module

    def _give_memory(self, module: Module, device: torch.device) -> None:
        """A module with placeholders used before its optimizer is set up: whole on ``device`` from now on."""
        if (hook := self._load_hooks.pop(module, None)) is not None:
            hook.remove()
        if (blockwise := self._placeholders.pop(module, None)) is not None:
            OffloadSession.give_placeholders_memory(blockwise, self.num_nodes * self.num_processes, device)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``fabric.setup_optimizers(optimizer)`` after ``fabric.setup_module(model)``: starts the engine as
        ``fabric.setup(model, optimizer)`` does, with the set-up module whose parameters the optimizer holds."""
        if self.session is not None:
            raise RuntimeError(
                "zero_offload trains one optimizer per Fabric, and one is set up already (fabric.setup or "
                "fabric.setup_optimizers). Put all parameters in param groups of one optimizer and set it up once: "
                "optimizer = fabric.setup_optimizers(optimizer)"
            )
        return self._start_session(self._module_trained_by(optimizer), [optimizer])  # type: ignore[return-value]

    def _module_trained_by(self, optimizer: Optimizer) -> Module:
        """The module from setup_module that holds every parameter of ``optimizer``."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        modules = [m for m in self._awaiting_optimizer if held <= {id(p) for p in m.parameters()}]
        if not modules:
            raise RuntimeError(
                "zero_offload starts the engine with the model and its optimizer together, but no model set up "
                "with fabric.setup_module holds the parameters of the optimizer given to fabric.setup_optimizers "
                "(it came first, or holds another model's parameters). Call model = fabric.setup_module(model) "
                "first, build the optimizer from model.parameters(), then optimizer = fabric.setup_optimizers("
                "optimizer); or model, optimizer = fabric.setup(model, optimizer)"
            )
        if len(modules) > 1:
            raise ValueError(
                f"zero_offload trains one model, and the parameters of the optimizer given to "
                f"fabric.setup_optimizers are in each of {len(modules)} models set up with fabric.setup_module "
                "(one inside another?). Say which: model, optimizer = fabric.setup(model, optimizer)"
            )
        return modules[0]

    def _start_session(self, module: Module, optimizers: list[Optimizer]) -> OffloadedOptimizer:
        self.precision.device_type = self.root_device.type
        world = self.num_nodes * self.num_processes
        args = (module, optimizers, self.root_device, self.precision.precision, self.options, world, self.num_processes)
        if self.options.offload_params:
            self.session = ParamOffloadSession.start(*args)
        else:  # a model built on the meta device is filled by the engine, block by block
            if (hook := self._load_hooks.pop(module, None)) is not None:
                hook.remove()
            blockwise = self._placeholders.pop(module, None) or OffloadSession.placeholders(
                module, self.root_device, optimizers
            )
            self.session = OffloadSession.start(*args, blockwise=blockwise)
        self.precision.session = self.session
        if (evaluation_hook := self._awaiting_optimizer.pop(module, None)) is not None:
            evaluation_hook.remove()
        if not self.options.offload_params:
            module.to(self.root_device)  # what the engine does not own (frozen parameters, buffers)
        return OffloadedOptimizer(self.session)

    # -- training --------------------------------------------------------------------------------

    @override
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        session = self._training_session()
        session.begin_backward()
        self.precision.backward(tensor, module, *args, **kwargs)
        session.finish_backward()

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
        session = self._training_session()
        norm = session.grad_norm(error_if_nonfinite)
        session.clip_norm(max_norm)
        return torch.tensor(norm)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self._training_session().clip_value(clip_val)

    def _training_session(self) -> OffloadSession:
        session = training_session(self.session)
        if session is not None:
            return session
        if self.session is None:
            raise RuntimeError(
                "zero_offload trains once an optimizer is set up, and none was: call "
                "fabric.setup_optimizers(optimizer) after setup_module, or fabric.setup(model, optimizer)"
            )
        raise RuntimeError("zero_offload's engine is closed (teardown): training with this Fabric has ended")

    # -- checkpoints -----------------------------------------------------------------------------

    def _owns(self, obj: Any) -> bool:
        """``obj`` is the trained module, or the ``_FabricModule`` (possibly compiled) that Fabric returned for it."""
        return self.session is not None and _unwrap_objects(obj) is self.session.module

    def master_state_dict(self, module: Module) -> dict[str, Any]:
        """``module.state_dict()`` with the fp32 master weights for the device copies (several ranks: call on all).

        ``module``: the model as ``fabric.setup`` returned it, or the module itself (``model.module``)."""
        return self.session.master_state_dict() if self._owns(module) else module.state_dict()

    @override
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The fp32 master state dict; sharded: without the trainable weights (each rank writes its shard)."""
        return self.session.module_state_to_save() if self._owns(module) else module.state_dict()

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
            "optimizer": next((k for k, v in state.items() if isinstance(v, OffloadedOptimizer)), None),
        }
        sharded = keys["model"] is not None and self.session.sharded
        if sharded:
            refuse_sharded_filter(filter, keys)
        # Views of the engine's buffers rather than a second copy of the fp32 state, when the writer is
        # the strategy's own (done when it returns; a user's CheckpointIO may write in the background).
        share = uses_own_writer(self.checkpoint_io, storage_options)
        with self.session.shared_buffers(share) if self.session is not None else nullcontext():
            checkpoint = self._convert_stateful_objects_in_state(state, filter=filter or {})
        if keys["model"] is not None:
            checkpoint[FABRIC_KEY] = keys  # where the weights are, for the fp32 export and sharded loading
        if sharded:
            checkpoint = sharded_from_fabric_checkpoint(checkpoint)
        save_checkpoint(
            self.session,
            checkpoint,
            path,
            checkpoint_io=self.checkpoint_io,
            storage_options=storage_options,
            rank=self.global_rank,
            broadcast=self.broadcast,
            sharded=sharded,
        )

    @override
    def load_checkpoint(
        self,
        path: Any,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """As Fabric's, for both formats; the sharded one is reassembled at this world size (with
        ``offload_params=True``: read in place into the shards and moments, every rank its own rows)."""
        loaded_in_place: set[str] = set()
        with_optimizer = _wants_optimizer(state)
        if loads_in_place(self.session, path, state):
            checkpoint = self.session.load_sharded(path, with_optimizer, strict)
            # a Trainer's checkpoint names its entries as the Trainer does
            keys = checkpoint.pop(FABRIC_KEY, {"model": "state_dict", "optimizer": "optimizer_states"})
            loaded_in_place = {keys["model"]} | ({keys["optimizer"]} if with_optimizer else set())
            loaded_in_place.discard(None)
            if not isinstance(state, dict):  # the module or the optimizer alone: loaded already
                return {}
        else:
            checkpoint = load_checkpoint(path, self.checkpoint_io, weights_only, with_optimizer=with_optimizer)
        if FORMAT_KEY in checkpoint:  # sharded: back under the names the Fabric run gave its entries
            checkpoint = fabric_checkpoint_from_sharded(checkpoint)
        else:
            checkpoint.pop(FABRIC_KEY, None)
        if isinstance(state, dict):
            _validate_keys_for_strict_loading(state.keys(), checkpoint.keys() | loaded_in_place, strict=strict)
        return restore_objects(
            state,
            checkpoint,
            lambda module, weights: self.load_module_state_dict(module, weights, strict),
            loaded=loaded_in_place,
        )

    @override
    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if self.options.offload_params and (self._owns(module) or _unwrap_objects(module) in self._awaiting_optimizer):
            ParamOffloadSession.load_module_state(_unwrap_objects(module), state_dict, strict)  # into FSDP2's shards
            return
        module.load_state_dict(state_dict, strict=strict)
        if self._owns(module):
            self.session.load_master_weights(state_dict, strict=strict)

    @override
    def teardown(self) -> None:
        if self.session is not None:
            self.session.close()  # the module gets the trained fp32 master weights back
        super().teardown()


def _wants_optimizer(state: Any) -> bool:
    return not isinstance(state, Module) and (
        not isinstance(state, dict) or any(isinstance(v, Optimizer) for v in state.values())
    )

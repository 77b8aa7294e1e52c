"""The session of ``offload_params=True``: the same door as :class:`~lightning_zero_offload.core.OffloadSession`,
for the parameter-offload engine (engine/offload_params/).

What differs for the front ends: the module is put on FSDP2 (:meth:`ParamOffloadSession.shard`) before the
optimizer is built, so the optimizer holds the sharded parameters; gradients are real tensors in ``p.grad``
(FSDP2's host shards), so user code reads and changes them there and nothing needs to be shown or taken
back beyond telling a speculated step that they may have changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from lightning_zero_offload.checkpoints import PathLike
from lightning_zero_offload.checkpoints.distributed import OpenedCheckpoint, load_sharded, save_sharded
from lightning_zero_offload.core.options import resolve_precision
from lightning_zero_offload.core.session_base import EngineSession, the_optimizer
from lightning_zero_offload.core.session_checkpoints import state_dict_keys
from lightning_zero_offload.engine import OffloadOptions, StepStats
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.full_state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_zero_offload.engine.offload_params.gathering import gather_for_calls, gather_for_training, reshard_all
from lightning_zero_offload.engine.offload_params.placement import device_resident, shard_model
from lightning_zero_offload.planner import check_host_memory
from lightning_zero_offload.planner.device_share import ShareChoice, auto_device_share

# The device share each module was sharded with (``device_share="auto"``: what it chose and why), for the
# session that starts on it: FSDP2 fixes where each unit's shards live when it wraps the unit.
_SHARES: WeakKeyDictionary[nn.Module, ShareChoice] = WeakKeyDictionary()


class ParamOffloadSession(EngineSession):
    """The parameter-offload engine training ``module`` (already sharded) through one optimizer."""

    loads_module_itself = True  # a module state dict goes into the shards here, not through load_state_dict
    engine: ParamOffloadEngine

    @staticmethod
    def shard(
        module: nn.Module,
        device: torch.device,
        precision: str,
        options: OffloadOptions,
        world_size: int,
        local_world_size: int = 1,
        optimizers: Sequence[torch.optim.Optimizer] = (),
    ) -> None:
        """Put ``module`` on FSDP2 over ``world_size`` ranks of the default group: its shards on the host,
        each block gathered to ``device`` as it runs (a module the user sharded keeps its units). FSDP2
        gathers the root's own parameters when ``module`` is called: a front end whose steps are other
        methods routes them through ``module.__call__`` (the Trainer strategy's forward redirection).

        ``optimizers`` built over the parameters before (Fabric's ``setup(model, optimizer)``) are given the
        sharded ones in their place, by name.
        """
        from torch.distributed.device_mesh import init_device_mesh

        for optimizer in optimizers:
            if optimizer.state:
                raise ValueError(
                    "offload_params replaces the model's parameters with FSDP2 shards, and the optimizer given has "
                    "state already: set the model and optimizer up first, then load the optimizer's state"
                )
            state_dict_keys(module, [p for group in optimizer.param_groups for p in group["params"]])  # refuses others
        names = {id(p): name for name, p in module.named_parameters()}
        _, param_dtype = resolve_precision(precision)
        if options.device_share == "auto":
            choice = auto_device_share(module, options, param_dtype, world_size, local_world_size, device)
        else:
            choice = ShareChoice(options.device_share, 0, "")
        _SHARES[module] = choice
        options = replace(options, device_share=choice.share)
        # Refused here, before a shard or a moment is allocated, if the host cannot hold the run.
        check_host_memory(module, options, param_dtype, world_size, local_world_size, device)
        # The sharded parameter is the master: bf16 with cpu_state="bf16", fp32 under mixed precision.
        master_dtype = torch.bfloat16 if options.cpu_state == "bf16" else None
        if master_dtype is None and param_dtype != torch.float32:
            master_dtype = torch.float32
        mesh = init_device_mesh(device.type, (world_size,))
        shard_model(
            module,
            mesh,
            param_dtype=param_dtype,
            master_dtype=master_dtype,
            device_share=options.device_share,
            pin_memory=options.pin_memory,
        )
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(p)]] for p in group["params"]]

    @staticmethod
    def gather_for_stage(module: nn.Module, running: bool) -> None:
        """A stage without training (``validate``/``test``/``predict``) begins (``running``): the units gather in the
        compute dtype, under the precision's autocast; it ends: in fp32 again, for calls outside the Trainer (a fit
        does both through :meth:`start` and :meth:`close`)."""
        (gather_for_training if running else gather_for_calls)(module)

    @classmethod
    def start(
        cls,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device,
        precision: str,
        options: OffloadOptions,
        world_size: int,
        local_world_size: int,
    ) -> ParamOffloadSession:
        optimizer = the_optimizer(optimizers)
        _, param_dtype = resolve_precision(precision)
        choice = _SHARES.get(module)
        options = replace(options, device_share=choice.share if choice is not None else 0.0)
        resident = device_resident(module)
        engine = ParamOffloadEngine(optimizer, device, param_dtype, options, world_size, local_world_size, resident)
        gather_for_training(module)  # an earlier fit left fp32 (close)
        return cls(module, engine)

    # -- what the engine is and did ----------------------------------------------------------------

    @property
    def share_choice(self) -> ShareChoice | None:
        """The device share the module was sharded with, and why (``device_share="auto"``); None if not set."""
        return _SHARES.get(self.module)

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def rollbacks(self) -> int:
        return self.engine.rollbacks

    # -- training ----------------------------------------------------------------------------------

    def expect_step(self, publish_early: bool = False) -> None:
        self.engine.expect_step(publish_early)

    def before_training_forward(self) -> None:
        """Nothing to re-plan: parameters unfrozen or added to the optimizer get their state at the step."""

    def begin_backward(self) -> None:
        self.check_no_clip_before_backward()
        self.engine.begin_backward()

    def finish_backward(self) -> None:
        self.engine.finish_backward()

    def show_gradients(self) -> bool:
        """User code may now read or change ``p.grad`` (it holds the gradients already); False under fp16,
        where they are still multiplied by the loss scale."""
        if not self.training:
            return False
        self.engine.before_user_code()
        return self.loss_scale is None

    def hide_gradients(self) -> None:
        self.engine.after_user_code()

    def grad_norm(self, error_if_nonfinite: bool = False) -> float:
        return self._checked_norm(self.engine.grad_norm(), error_if_nonfinite)

    def step(self) -> StepStats:
        clip, self._clip = self._clip, {}
        self.engine.after_user_code()  # the Trainer shows the gradients before on_before_optimizer_step
        reshard_all(self.module)  # the step writes the shards: no gathered copy may outlive it
        return self.engine.step(**clip)

    def skip_step(self) -> None:
        self._clip = {}
        self.engine.skip_step()

    def sync(self) -> None:
        """The parameters are the master: nothing to bring up to date."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip = {}
        if self.training:
            self.engine.zero_grad(set_to_none)

    def close(self, after_failure: bool = False) -> None:
        self.engine.close()
        if not after_failure:  # outside fit no autocast: fp32 inputs meet the weights as under auto
            gather_for_calls(self.module)

    # -- checkpoints (the full format: gathered whole on rank 0, engine/offload_params/full_state.py) ------

    @property
    def sharded(self) -> bool:
        """Checkpoints through ``torch.distributed.checkpoint`` (``checkpoint_format="sharded"``)."""
        return self.options.checkpoint_format == "sharded"

    def shared_buffers(self, share: bool = True) -> AbstractContextManager[None]:
        return nullcontext()  # the full state is gathered into new tensors; the sharded one is saved as it lies

    def master_state_dict(self) -> dict[str, Any]:
        """``module.state_dict()`` with every sharded tensor whole (on rank 0; a collective)."""
        return full_model_state(self.module)

    def module_state_to_save(self) -> dict[str, Any]:
        """The full state dict; sharded: this rank's shards as ``torch.distributed.checkpoint`` saves them (views,
        nothing copied; :meth:`save_sharded` writes what the checkpoint hooks leave of it)."""
        return get_model_state_dict(self.module) if self.sharded else self.master_state_dict()

    def optimizer_state_to_save(self) -> dict[str, Any]:
        """The optimizer state in torch AdamW's format, the moments whole (a collective); sharded: nothing here."""
        return {} if self.sharded else full_optimizer_state(self.engine)

    def save_sharded(self, checkpoint: dict[str, Any], path: PathLike, rank: int, broadcast: Callable) -> None:
        """Every rank writes its shards (those of ``checkpoint["state_dict"]``: a hook may have left some out), and
        with the optimizer's entry (not a weights-only save) its moments and step counts; rank 0 the rest of
        ``checkpoint`` (the loops', callbacks' and schedulers' state): a new version under ``path``, at any world
        size resumable."""
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        with_optimizer = "optimizer_states" in checkpoint
        save_sharded(path, self.module, self.engine, extra, with_optimizer, checkpoint.get("state_dict"))

    def load_sharded(self, path: PathLike, with_optimizer: bool = True, strict: bool = True) -> dict[str, Any]:
        """A sharded checkpoint in place into the shards (and moments, step counts, hyperparameters and the
        engine's counters); returns the rest of the checkpoint as saved. Every rank calls it."""
        return load_sharded(path, self.module, self.engine, with_optimizer, strict=strict)

    def load_opened(self, checkpoint: OpenedCheckpoint, model: bool, optimizer: bool, strict: bool = True) -> None:
        """Parts of an opened sharded checkpoint in place (:meth:`load_sharded` in two calls). Every rank calls it."""
        checkpoint.load(self.module, self.engine, model, optimizer, strict)

    def engine_state_dict(self) -> dict[str, Any]:
        return self.engine.state_dict()

    def save_full(
        self, checkpoint: dict[str, Any], rank: int, broadcast: Callable, write: Callable[[dict[str, Any], None], None]
    ) -> None:
        """Rank 0 writes the checkpoint, which holds every tensor whole already."""
        if rank == 0:
            write(checkpoint, None)

    @staticmethod
    def load_module_state(module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        """A full module state dict into a sharded module (each rank keeps its rows)."""
        load_full_model_state(module, state_dict, strict)

    def load_master_weights(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        self.load_module_state(self.module, state_dict, strict)

    def load_optimizer_state(self, state_dict: dict[str, Any]) -> None:
        load_full_optimizer_state(self.engine, state_dict)

    def load_engine_state(self, state: dict[str, Any]) -> None:
        self.engine.load_state_dict(state)

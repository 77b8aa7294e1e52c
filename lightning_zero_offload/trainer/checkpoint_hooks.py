"""Lightning glue for the Trainer's checkpoints: its checkpoint hooks and ``fit(weights_only=...)``.

:class:`TrainerCheckpoints` translates the Trainer's checkpoint hooks into calls on the strategy's
:class:`~lightning_zero_offload.core.OffloadSession` (fp32 master weights, torch AdamW optimizer format,
full or sharded). Which writer and reader a path gets, and their guards and warnings, are the one
checkpoint path both front ends share (core/checkpoint_io.py).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_zero_offload.checkpoints.distributed import OpenedCheckpoint, is_distributed_checkpoint
from lightning_zero_offload.core import OffloadSession, ParamOffloadSession, training_session
from lightning_zero_offload.core.checkpoint_io import load_checkpoint, save_checkpoint, uses_own_writer


def restore_finetuning_groups(trainer: Trainer) -> None:
    """Lightning's finetuning callbacks (``BaseFinetuning``: ``BackboneFinetuning``, users' own) put back the param
    groups they added, from their checkpointed state, in ``on_fit_start``. A strategy that restores the checkpoint
    after setup (this one, as Lightning's FSDP one) loads that state after ``on_fit_start``, so the optimizer would
    lack those groups when its state is loaded: they are put back here, just before, as under ``"auto"``. Only
    ``BaseFinetuning``'s own restore runs here, not what a subclass's ``on_fit_start`` adds to it."""
    for callback in trainer.callbacks:
        if isinstance(callback, BaseFinetuning) and getattr(callback, "_restarting", False):
            BaseFinetuning.on_fit_start(callback, trainer, trainer.lightning_module)


def _weights_only_resume_message(path: Any) -> str:
    """Why ``fit(ckpt_path=path)`` cannot resume from a weights-only checkpoint, and the ways on.

    A ``KeyError``'s message, as Lightning raises for it (which names neither the strategy nor a fix).
    """
    return (
        f"zero_offload cannot resume trainer.fit(ckpt_path={str(path)!r}): the checkpoint holds only the model "
        "weights, no optimizer state. This is probably due to `ModelCheckpoint.save_weights_only` being set to "
        "`True` (or trainer.save_checkpoint(..., weights_only=True)). To resume training, save with "
        "save_weights_only=False. To start a new fit from these weights, load them into the model with "
        "model.load_state_dict(lightning_zero_offload.convert_checkpoint_to_fp32_state_dict(path)) (either "
        "checkpoint_format) and call trainer.fit without ckpt_path; validate/test/predict(ckpt_path=...) load them as "
        "they are"
    )


def fitting(trainer: Trainer | None) -> bool:
    """``trainer`` runs ``fit`` (not validate, test or predict): the session trains and loads optimizer state."""
    return trainer is not None and trainer.state.fn == TrainerFn.FITTING


class TrainerCheckpoints(Strategy):
    """The Trainer's checkpoint hooks for a strategy whose ``session`` (set up by ``fit``) holds the weights
    and the optimizer state. Mixed in before the strategy's base class."""

    session: OffloadSession | ParamOffloadSession | None
    # A sharded checkpoint of offload_params=True loads straight into the shards (Lightning's own loading of its
    # dict then has nothing to do): the model at once, the optimizer state where Lightning loads it.
    _model_loaded_in_place = False
    _optimizer_to_load: OpenedCheckpoint | None = None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the master weights and moments live in the engine, which setup() creates

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the fp32 master weights in place of the device copies.

        Sharded: the trainable weights are left out here; each rank writes its shard of them instead.
        """
        assert self.lightning_module is not None
        if self.session is None:
            return self.lightning_module.state_dict()
        # Lightning calls this to save: views of the engine's buffers (as a plain module's state_dict
        # holds its live parameters), not a second copy, when the writer is done when it returns; at
        # several ranks views of placeholders that save_checkpoint fills as it writes.
        with self.session.shared_buffers(uses_own_writer(self.checkpoint_io)):
            return self.session.module_state_to_save()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self.session is None:
            return super().optimizer_state(optimizer)
        with self.session.shared_buffers(uses_own_writer(self.checkpoint_io)):
            return self.session.optimizer_state_to_save()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Full: rank 0 writes one file. Sharded: every rank writes its shard into a new version directory.

        Either way the new checkpoint is complete before it replaces an existing one (docs/checkpoints.md).
        """
        sharded = self.session is not None and self.session.sharded
        save_checkpoint(
            self.session,
            checkpoint,
            filepath,
            checkpoint_io=self.checkpoint_io,
            storage_options=storage_options,
            rank=self.global_rank,
            broadcast=self.broadcast,
            sharded=sharded,
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any filesystem; ``weights_only`` as passed to ``fit`` (Lightning 2.4+ alike)."""
        if weights_only is None:
            weights_only = getattr(self, "_weights_only", None)
        training = fitting(getattr(self.lightning_module, "_trainer", None))  # else no optimizer state is read
        # In place into the shards only for the module this fit trains: after a fit, validate/test/predict of
        # another module would load into the last fit's module (and evaluate the new one as built).
        session = training_session(self.session)
        in_place = isinstance(session, ParamOffloadSession) and session.module is self.lightning_module
        if in_place and is_distributed_checkpoint(checkpoint_path):
            opened = OpenedCheckpoint(checkpoint_path, weights_only=weights_only is not False)
            if training and not opened.info["with_optimizer"]:
                raise KeyError(_weights_only_resume_message(checkpoint_path))
            strict = getattr(self.lightning_module, "strict_loading", True)
            session.load_opened(opened, model=True, optimizer=False, strict=strict)
            self._model_loaded_in_place = True
            self._optimizer_to_load = opened if training else None
            return {**opened.extra, "state_dict": {}, "optimizer_states": [{}]}
        checkpoint = load_checkpoint(checkpoint_path, self.checkpoint_io, weights_only, with_optimizer=training)
        if "optimizer_states" not in checkpoint and training:
            raise KeyError(_weights_only_resume_message(checkpoint_path))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self._model_loaded_in_place:
            self._model_loaded_in_place = False
            return
        if getattr(self, "options", None) is not None and self.options.offload_params:
            assert self.lightning_module is not None  # sharded by FSDP2: load_state_dict cannot copy into it
            ParamOffloadSession.load_module_state(self.lightning_module, checkpoint["state_dict"], strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)
        if self.session is not None:
            self.session.load_master_weights(checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        session = training_session(self.session)
        if session is None:
            return super().load_optimizer_state_dict(checkpoint)
        restore_finetuning_groups(self.lightning_module.trainer)
        if self._optimizer_to_load is not None:
            opened, self._optimizer_to_load = self._optimizer_to_load, None
            assert isinstance(session, ParamOffloadSession)
            return session.load_opened(opened, model=False, optimizer=True)
        states = checkpoint["optimizer_states"]
        if len(states) != 1:
            raise ValueError(f"expected one optimizer state in the checkpoint, found {len(states)}")
        session.load_optimizer_state(states[0])

"""Lightning glue for the optimizer step: run the closure, then the offload engine instead of ``optimizer.step``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_zero_offload.core import ENGINE_STATE_KEY, OffloadSession, resolve_precision, training_session
from lightning_zero_offload.mixed_precision import forward_context
from lightning_zero_offload.trainer.callbacks import OffloadMetrics
from lightning_zero_offload.warning import ZeroOffloadWarning

__all__ = ["ENGINE_STATE_KEY", "ZeroOffloadPrecision"]

# Where Lightning's precision plugins with a GradScaler save its state: their class names (AMP's first, which
# strategy="auto" and DDP read).
_AMP_STATE_KEY = "MixedPrecision"
_AMP_STATE_KEYS = (_AMP_STATE_KEY, "FSDPPrecision")


class ZeroOffloadPrecision(Precision):
    """Precision for ``zero_offload``: what the device holds and how the step is taken.

    - ``"bf16-mixed"`` / ``"16-mixed"``: bf16/fp16 parameters and gradients on the device, forward under
      autocast, fp32 master weights and Adam on the CPU (DeepSpeed's meaning of mixed precision). Buffers
      stay fp32 and norms see fp32 weights, as under AMP (:mod:`lightning_zero_offload.mixed_precision`).
    - ``"32-true"``: fp32 everywhere; the step still runs on the CPU, so device memory holds no optimizer state.

    fp16 uses dynamic loss scaling; the overflow check and unscaling are fused into the CPU kernels.
    """

    def __init__(self, precision: str = "bf16-mixed") -> None:
        self.precision, self.param_dtype = resolve_precision(precision)  # type: ignore[assignment]
        self.device_type = "cpu"  # set by the strategy once the device is known
        self.session: OffloadSession | None = None
        self._pending_state: dict[str, Any] | None = None  # engine state loaded before the engine existed
        self._window_ends = False  # the backward running now is the last of an accumulation window
        self._told_hook = False  # the note that a hook keeps the speculated steps off the device during backward

    def forward_context(self) -> AbstractContextManager:
        return forward_context(self.device_type, self.param_dtype)

    @override
    def train_step_context(self) -> AbstractContextManager:
        if self.session is not None:
            self.session.before_training_forward()
        return self.forward_context()

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        return self.session.scale_loss(tensor) if self.session is not None else tensor

    @override
    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:
        """Lightning runs ``on_after_backward`` here: ``p.grad`` shows the window's gradients so far where a
        hook may read them (one rank, or the end of the window: at several ranks a micro-batch inside the
        window has no local gradient to show, its gradient having left reduced across ranks)."""
        session = training_session(self.session)
        if session is None:
            return super().post_backward(tensor, module)
        session.finish_backward()  # the strategy's post_backward, after these hooks, repeats it (a no-op)
        world = session.world_size
        automatic = getattr(module, "automatic_optimization", True)
        show = _hook_reading_gradients(module, _AFTER_BACKWARD_HOOKS) is not None and (
            world == 1 or self._window_ends or not automatic
        )
        shown = show and session.show_gradients()
        try:
            return super().post_backward(tensor, module)
        finally:
            if shown:
                session.hide_gradients()

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if kwargs:
            raise TypeError(f"zero_offload's optimizer step takes no extra arguments, got {sorted(kwargs)}")
        session = self._training_session("The offload engine is not set up: optimizer steps are")
        # In automatic optimization the closure runs the backward that ends the accumulation window, so a
        # step follows it: the speculative schedule may run the CPU step during that backward. (Manual
        # optimization has run its backward already; its step then runs after it, as in sync.)
        hook = _hook_before_step(model)
        if (
            hook is not None
            and not self._told_hook
            and session.resolved.cpu_step == "speculative"
            and session.world_size == 1
        ):
            self._told_hook = True
            rank_zero_info(
                f"zero_offload: {hook} runs between backward and the optimizer step, so the parameters keep their "
                "values until the step, and the speculated updates are copied to the device after backward instead "
                "of during it. If that hook neither reads nor writes a parameter, set `reads_weights_before_step = "
                "False` on its class."
            )
        session.expect_step(publish_early=hook is None)
        self._window_ends = True
        try:
            closure_result = closure()
        finally:
            self._window_ends = False
        # training_step returned None in automatic optimization: torch's step runs on the gradients the
        # window has; only AMP's loss scaler (fp16) skips the step then, having no gradient to unscale.
        skip = (
            closure_result is None
            and getattr(model, "automatic_optimization", True)
            and self.param_dtype == torch.float16
        )
        if not skip and _hook_reading_gradients(model, _BEFORE_STEP_HOOKS) is not None:
            session.show_gradients()  # taken back by the step
        # on_before_optimizer_step hooks, then clip_gradients (manual optimization has recorded its clip already)
        self._after_closure(model, optimizer)
        if skip:
            session.skip_step()
        else:
            session.step()
        return closure_result

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Record the clip for the coming step; the engine applies it on the CPU buffers, fused into the step."""
        if clip_val <= 0:
            return
        session = self._training_session("Gradient clipping under zero_offload is")
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            session.clip_value(clip_val)
        else:
            session.clip_norm(clip_val)

    def _training_session(self, what: str) -> OffloadSession:
        session = training_session(self.session)
        if session is None:
            raise RuntimeError(f"{what} only possible during fit")
        return session

    # The engine's state is a top-level checkpoint entry, ENGINE_STATE_KEY, rather than this plugin's
    # class-name entry, so a Fabric run reads the same state.

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.session is not None:
            checkpoint[ENGINE_STATE_KEY] = self.session.engine_state_dict()
            # fp16: the loss scale also where Lightning's AMP plugin reads its GradScaler's, so a run resumed
            # under strategy="auto" (or DDP) continues with it rather than its initial scale.
            amp_state = self.session.grad_scaler_state_dict()
            if amp_state is not None:
                checkpoint[_AMP_STATE_KEY] = amp_state

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if ENGINE_STATE_KEY in checkpoint:
            self._load_engine_state(checkpoint[ENGINE_STATE_KEY])
            return
        # A checkpoint of Lightning's AMP (or FSDP) precision in fp16: its GradScaler's scale carries over.
        amp_state = next((checkpoint[key] for key in _AMP_STATE_KEYS if checkpoint.get(key)), None)
        if amp_state is not None and "scale" in amp_state:
            self._load_engine_state({"loss_scaler": amp_state})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint written by 0.1.0: the engine state under this plugin's class-name key."""
        if state_dict:
            state = {"step_calls": state_dict.get("step_calls", 0), "loss_scaler": state_dict.get("loss_scaler")}
            if state_dict.get("dpu_pending") is not None:  # only DPU had pending state then
                state["schedule"] = {"name": "delayed", "pending": state_dict["dpu_pending"]}
            self._load_engine_state(state)

    def _load_engine_state(self, state: dict[str, Any]) -> None:
        session = training_session(self.session)
        if session is None:
            self._pending_state = state
        else:
            session.load_engine_state(state)

    def attach(self, session: OffloadSession) -> None:
        self.session = session
        if self.param_dtype == torch.float32 and not session.resolved.in_place:
            # The point of offloading is a 2-byte device copy. The plugin cannot tell a passed "32-true" from
            # Lightning's default, so the text holds for both; in place there is no device copy to shrink.
            master = session.options.cpu_state
            holds = (
                "the blocks in flight compute in fp32 on the device (4 B/param for their weights and gradients)"
                if session.resolved.offload_params
                else "the device holds fp32 weights and gradients (4 B/param)"
            )
            rank_zero_warn(
                "zero_offload is training in '32-true' (the precision passed, or Lightning's default when none is "
                f"given): {holds}. Pass precision='bf16-mixed' (or '16-mixed' on GPUs without bf16) to keep a "
                f"2 B/param copy on the device with {master} master weights on the CPU; if fp32 on the device is "
                "what you want, or the device is a CPU without native bf16 (AVX-512 BF16, AMX), where fp32 is "
                "faster, this warning can be ignored.",
                category=ZeroOffloadWarning,
            )
        if self._pending_state is not None:
            session.load_engine_state(self._pending_state)
            self._pending_state = None


# The hooks Lightning runs between the closure's backward and the optimizer step (an overridden
# ``backward`` may run code after ``loss.backward()``).
_MODULE_HOOKS_BEFORE_STEP = ("backward", "on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping")
_CALLBACK_HOOKS_BEFORE_STEP = ("on_after_backward", "on_before_optimizer_step")


# The hooks in which a user's code may read p.grad, as under torch (a class that sets ``reads_gradients =
# False`` is trusted not to, and saves the copies that showing them takes).
_AFTER_BACKWARD_HOOKS = (("on_after_backward",), ("on_after_backward",))
_BEFORE_STEP_HOOKS = (("on_before_optimizer_step", "configure_gradient_clipping"), ("on_before_optimizer_step",))


def _hook_reading_gradients(model: Any, hooks: tuple[tuple[str, ...], tuple[str, ...]]) -> str | None:
    """The first of ``hooks`` (the module's, the callbacks') that the user overrides, or None."""
    if not isinstance(model, L.LightningModule):
        return None
    module_hooks, callback_hooks = hooks
    return _first_overridden(model, module_hooks, callback_hooks, "reads_gradients")


def _first_overridden(
    model: L.LightningModule, module_hooks: tuple[str, ...], callback_hooks: tuple[str, ...], trust: str
) -> str | None:
    owners: list[tuple[Any, type, tuple[str, ...]]] = [(model, L.LightningModule, module_hooks)]
    for callback in model.trainer.callbacks:
        parent = OffloadMetrics if isinstance(callback, OffloadMetrics) else L.Callback  # ours reads neither
        owners.append((callback, parent, callback_hooks))
    for owner, parent, names in owners:
        if getattr(owner, trust, True) is False:
            continue
        for hook in names:
            if is_overridden(hook, owner, parent):
                return f"{type(owner).__name__}.{hook}"
    return None


def _hook_before_step(model: Any) -> str | None:
    """The first user hook that runs between backward and the step, where it may read or write the
    parameters, which must then hold their values from before the step (as under any optimizer) until
    it runs; None if there is none. A class that sets ``reads_weights_before_step = False`` is trusted."""
    if not isinstance(model, L.LightningModule):
        return f"{type(model).__name__} (not a LightningModule: its hooks cannot be told)"
    return _first_overridden(model, _MODULE_HOOKS_BEFORE_STEP, _CALLBACK_HOOKS_BEFORE_STEP, "reads_weights_before_step")

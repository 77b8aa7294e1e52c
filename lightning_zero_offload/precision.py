"""Lightning glue for the optimizer step: run the closure, then the offload engine instead of ``optimizer.step``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.mixed_precision import forward_context

ENGINE_STATE_KEY = "zero_offload_engine"
_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "32-true": torch.float32}
_ALIASES = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true"}
_ALTERNATIVES = {
    "bf16-true": "'bf16-mixed' (it already keeps bf16 weights on the device; fp32 master weights stay on the CPU)",
    "16-true": "'16-mixed' (it already keeps fp16 weights on the device; fp32 master weights stay on the CPU)",
    "64-true": "'32-true'",
    "transformer-engine": "'bf16-mixed'",
    "transformer-engine-float16": "'16-mixed'",
}


def resolve_precision(precision: str) -> tuple[str, torch.dtype]:
    """The canonical precision name and the dtype of the device parameters; unsupported names are refused
    with the supported alternative (shared by the Trainer and the Fabric plugins)."""
    precision = _ALIASES.get(str(precision), str(precision))
    if precision not in _DTYPES:
        alternative = _ALTERNATIVES.get(precision)
        hint = f"use precision={alternative}" if alternative else f"choose one of {sorted(_DTYPES)}"
        raise ValueError(f"zero_offload does not support precision={precision!r}: {hint}.")
    return precision, _DTYPES[precision]


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
        self.engine: OffloadEngine | None = None
        self._pending_state: dict[str, Any] | None = None
        self._clip: dict[str, float] = {}  # set by clip_gradients between backward and the step

    def forward_context(self) -> AbstractContextManager:
        return forward_context(self.device_type, self.param_dtype)

    @override
    def train_step_context(self) -> AbstractContextManager:
        if self.engine is not None and not self.engine.closed:
            self.engine.replan_if_changed()  # unfrozen parameters / added groups, before forward uses them
        return self.forward_context()

    @override
    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:
        tensor = super().pre_backward(tensor, module)
        return self.engine.scale_loss(tensor) if self.engine is not None else tensor

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if kwargs:
            raise TypeError(f"zero_offload's optimizer step takes no extra arguments, got {sorted(kwargs)}")
        if self.engine is None or self.engine.closed:
            raise RuntimeError("The offload engine is not set up: optimizer steps are only possible during fit")
        # In automatic optimization the closure runs the backward that ends the accumulation window, so a
        # step follows it: the speculative schedule may run the CPU step during that backward. (Manual
        # optimization has run its backward already; its step then runs after it, as in sync.)
        self.engine.expect_step()
        closure_result = closure()
        # Like AMP: training_step returned None in automatic optimization means "skip this step".
        skip = closure_result is None and getattr(model, "automatic_optimization", True)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clip_gradients
        # Manual optimization records the clip before calling optimizer.step(); automatic in _after_closure.
        clip, self._clip = self._clip, {}
        if skip:
            self.engine.expect_step(False)
            self.engine.finish_backward()
        else:
            self.engine.step(**clip)
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
        if self.engine is None or self.engine.closed:
            raise RuntimeError("Gradient clipping under zero_offload is only possible during fit")
        name = "clip_value" if gradient_clip_algorithm == GradClipAlgorithmType.VALUE else "clip_norm"
        self._clip[name] = float(clip_val)

    # The engine's state (step count, loss scaler, pending schedule state) is a top-level checkpoint entry,
    # ENGINE_STATE_KEY, rather than this plugin's class-name entry, so a Fabric run reads the same state.

    @override
    def state_dict(self) -> dict[str, Any]:
        return {}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.engine is not None:
            checkpoint[ENGINE_STATE_KEY] = self.engine.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if ENGINE_STATE_KEY in checkpoint:
            self._load_engine_state(checkpoint[ENGINE_STATE_KEY])

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A checkpoint written by 0.1.0: the engine state under this plugin's class-name key."""
        if state_dict:
            state = {"step_calls": state_dict.get("step_calls", 0), "loss_scaler": state_dict.get("loss_scaler")}
            if state_dict.get("dpu_pending") is not None:  # only DPU had pending state then
                state["schedule"] = {"name": "delayed", "pending": state_dict["dpu_pending"]}
            self._load_engine_state(state)

    def _load_engine_state(self, state: dict[str, Any]) -> None:
        if self.engine is None or self.engine.closed:
            self._pending_state = state
        else:
            self.engine.load_state_dict(state)

    def attach(self, engine: OffloadEngine) -> None:
        self.engine = engine
        if self.param_dtype == torch.float32 and not engine.in_place:
            # The point of offloading is a 2-byte device copy. The plugin cannot tell a passed "32-true" from
            # Lightning's default, so the text holds for both; in place there is no device copy to shrink.
            rank_zero_warn(
                "zero_offload is training in '32-true' (the precision passed, or Lightning's default when none is "
                "given): the device holds fp32 weights and gradients (4 B/param). Pass precision='bf16-mixed' (or "
                "'16-mixed' on GPUs without bf16) to keep a 2 B/param copy on the device with fp32 master weights on "
                "the CPU; if fp32 on the device is what you want, or the device is a CPU without native bf16 "
                "(AVX-512 BF16, AMX), where fp32 is faster, this warning can be ignored."
            )
        if self._pending_state is not None:
            engine.load_state_dict(self._pending_state)
            self._pending_state = None

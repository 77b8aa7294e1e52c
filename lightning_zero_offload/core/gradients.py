"""``p.grad`` under zero_offload: torch's contract for a parameter's gradient, kept while the gradients
themselves live in the engine (CPU buffers, sharded across ranks), not in ``.grad``.

torch says: after a backward, ``p.grad`` holds the gradient accumulated since the last ``zero_grad``; the
step reads it, and keeps it; ``p.grad = None`` (``model.zero_grad()``) drops it, an assigned tensor
replaces it, an in-place change (clipping) changes what the step uses. Here:

- After every backward each trainable parameter that has a gradient gets a :class:`HeldGradient` as its
  ``.grad``: a tensor with the gradient's shape, dtype and device and no storage, whose every use raises
  an error that says where the gradient is and what to do instead (``zero_()`` is recorded: it is the
  gradient made zero). So ``p.grad is None`` answers as under torch, and code that reads gradients where
  zero_offload cannot show them fails loudly instead of computing with nothing.
- Where a front end knows user code runs that may read them (a LightningModule's or a callback's
  ``on_after_backward``, ``on_before_optimizer_step``, ``configure_gradient_clipping``), the real
  gradients are shown (:meth:`GradientView.show`): gathered whole, in ``.grad``, in the parameter's
  device and dtype; in place the step's own tensors.
- Before the next backward, step or ``zero_grad`` (:meth:`GradientView.take_back`), what user code did
  is given to the engine: a gradient dropped, assigned, zeroed, or a shown one changed (found by
  comparing values, so ``p.grad.data.mul_()`` counts too).

What it costs: a placeholder is one small Python object per parameter, kept; showing costs a gather (at
several ranks), one copy to the device and one back for the comparison, only while such a hook exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from lightning_zero_offload.engine import OffloadEngine

_WHERE_TO_READ = (
    "Gradients are shown in p.grad in a LightningModule's or callback's on_after_backward, "
    "on_before_optimizer_step and configure_gradient_clipping (automatic optimization, bf16-mixed or 32-true). "
    "To clip, use Trainer(gradient_clip_val=...), self.clip_gradients(optimizer, ...) or fabric.clip_gradients("
    "...); to drop gradients, optimizer.zero_grad(). A backward must go through the Trainer, "
    "self.manual_backward(loss) or fabric.backward(loss), not loss.backward()."
)


class HeldGradient(torch.Tensor):
    """``p.grad`` of a parameter whose gradient zero_offload holds on the CPU: metadata only."""

    why: ClassVar[str] = "it lives in zero_offload's CPU buffers, not in p.grad"

    @staticmethod
    def __new__(cls, param: torch.Tensor) -> HeldGradient:
        held = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        held.zeroed = False
        return held

    def __repr__(self) -> str:  # type: ignore[override]
        return f"HeldGradient(shape={tuple(self.shape)}, dtype={self.dtype}: held by zero_offload on the CPU)"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.zero_.default and isinstance(args[0], HeldGradient):
            args[0].zeroed = True  # optimizer.zero_grad(set_to_none=False) on the parameter: taken back later
            return args[0]
        raise RuntimeError(
            f"zero_offload: {func} on a parameter's .grad, which cannot be read or changed here because "
            f"{cls.why}. {_WHERE_TO_READ}"
        )


class GradientView:
    """Keeps each trainable parameter's ``.grad`` telling the truth about the engine's gradients."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine
        self._held: dict[int, HeldGradient] = {}  # id(param) -> its placeholder (kept: one object each)
        # Keyed by id(param), not by the engine's index, which a re-plan (a layer unfrozen) changes mid-window.
        self._shown: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (in .grad, the source)
        self._marked: set[int] = set()  # parameters given a placeholder since the last clear

    def _placeholder(self, param: torch.Tensor) -> HeldGradient:
        held = self._held.get(id(param))
        if held is None or held.dtype != param.dtype or held.shape != param.shape or held.device != param.device:
            held = self._held[id(param)] = HeldGradient(param)
        return held

    def mark(self) -> None:
        """Placeholders on the parameters that have a gradient (on this rank); nothing on the others."""
        has_grad = self.engine.grads.has_grad
        self._marked = {id(param) for param, has in zip(self.engine.params, has_grad) if has}
        for param in self.engine.params:
            param.grad = self._placeholder(param) if id(param) in self._marked else None

    def clear(self) -> None:
        """No ``.grad`` on any trainable parameter (before a backward, which must not add into one)."""
        for param in self.engine.params:
            param.grad = None
        self._shown, self._marked = {}, set()

    def show(self) -> None:
        """The real gradients in ``.grad`` (whole, unscaled, in the parameter's device and dtype).

        A collective when the state is sharded: every rank calls it."""
        self.take_back()
        for param, value in zip(self.engine.params, self.engine.gradients()):
            if value is None:
                param.grad = None
                continue
            if self.engine.in_place:
                shown = value.view(param.shape)  # the step's own tensor: changes to it are the step's input
            else:
                shown = value.view(param.shape).to(device=param.device, dtype=param.dtype, copy=True)
            param.grad = shown
            self._shown[id(param)] = (shown, value)

    def take_back(self) -> None:
        """Give the engine what user code did to ``.grad`` since the engine last set it."""
        shown, self._shown = self._shown, {}
        marked = self._marked
        changes: dict[int, torch.Tensor | None] = {}  # by the engine's index
        dropped: set[int] = set()
        for index, param in enumerate(self.engine.params):
            grad = param.grad
            if isinstance(grad, HeldGradient):
                if grad.zeroed:
                    grad.zeroed = False
                    changes[index] = torch.zeros(param.shape)
                continue
            if grad is None:
                if id(param) in marked or id(param) in shown:
                    changes[index] = None  # dropped (p.grad = None, model.zero_grad())
                    dropped.add(id(param))
                continue
            given = shown.get(id(param))
            if given is None or grad is not given[0]:
                changes[index] = grad.detach()  # assigned
            elif self.engine.in_place or not torch.equal(grad.detach().cpu(), given[1].to(grad.dtype)):
                changes[index] = grad.detach()  # the shown tensor, changed (in place: it is the step's input)
        had = marked | set(shown)
        if had and dropped == had and len(changes) == len(dropped):
            self.engine.zero_grad()  # every gradient dropped (model.zero_grad()): the whole window goes
        else:
            self.engine.set_gradients(changes)

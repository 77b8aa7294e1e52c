"""The optimizer users and Lightning hold: the user's optimizer with its step, ``zero_grad`` and state
taken by the session, behaving as torch's optimizer contract says.

- ``step()`` updates from the gradients of the window and keeps them (a second ``step()`` without a
  backward steps again; a backward without ``zero_grad()`` adds to them); ``step(closure)`` runs the
  closure first and returns its loss.
- ``zero_grad()`` drops the gradients; ``zero_grad(set_to_none=False)`` makes them zero, so their
  parameters are still updated (moments, weight decay) by the next step.
- ``state_dict()`` / ``load_state_dict()``: torch AdamW's format (sharded: the param groups only, the
  moments are in the shards) plus the engine's own state under ``ENGINE_STATE_KEY``, so a checkpoint of
  it resumes the engine too.
- ``state``: each parameter's ``step``, ``exp_avg`` and ``exp_avg_sq`` (a frozen one's too, once it trained), the
  moments as live views of the engine's state (core/param_states.py: ZeRO-2 at one rank, at several ``state``
  refuses and names the state-dict route; offload_params as DTensors at any world size). Deleting a
  parameter's entry (or ``state.clear()``) resets it as torch would.
- ``param_groups``: the wrapped optimizer's, read live by the engine; assigning them assigns its.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from lightning_zero_offload.checkpoints import ENGINE_STATE_KEY
from lightning_zero_offload.core.param_states import ParamStates
from lightning_zero_offload.core.session import OffloadSession, training_session


class OffloadedOptimizer:
    """The user's optimizer with its step taken by the session (the Trainer's ``trainer.optimizers`` and
    the one ``fabric.setup`` returns).

    Imitates the wrapped optimizer's class (as Fabric's own wrapper does), so ``isinstance`` checks and
    LR schedulers work, and compares equal to it (Lightning looks schedulers' optimizers up among its
    optimizers); ``param_groups`` are the wrapped optimizer's, which the engine reads live. Every method
    reaches the session through ``self._session``: a Lightning or Fabric wrapper of this object runs them
    with itself as ``self`` and finds the session by attribute lookup.
    """

    def __init__(self, session: OffloadSession) -> None:
        self._session = session
        self._optimizer = session.optimizer
        self.__class__ = type(
            "ZeroOffload" + self._optimizer.__class__.__name__, (OffloadedOptimizer, self._optimizer.__class__), {}
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._session.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._session.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        """Assigned groups are the wrapped optimizer's (Lightning's finetuning callbacks restore theirs so)."""
        self._session.optimizer.param_groups = groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The step on the CPU; with a ``closure``, that closure (forward and backward) runs first and its
        loss is returned, as torch's ``step(closure)`` does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._training_session().step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._session.zero_grad(set_to_none)

    @property
    def state(self) -> MutableMapping:
        return ParamStates(self._session)

    @state.setter
    def state(self, value: MutableMapping) -> None:
        """``optimizer.state = defaultdict(dict)`` (a reset of every parameter), or a mapping to copy in."""
        states = ParamStates(self._session)
        states.clear()
        for param, entry in value.items():
            states[param] = entry

    def state_dict(self) -> dict[str, Any]:
        state = self._session.optimizer_state_to_save()
        state[ENGINE_STATE_KEY] = self._session.engine_state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        session = self._training_session()
        session.load_optimizer_state(state_dict)
        if ENGINE_STATE_KEY in state_dict:
            session.load_engine_state(state_dict[ENGINE_STATE_KEY])

    def _training_session(self) -> OffloadSession:
        session = training_session(self._session)
        if session is None:
            raise RuntimeError("The offload engine is closed: training with this optimizer has ended")
        return session

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._session.optimizer

    def __hash__(self) -> int:
        return hash(self._session.optimizer)

    def __getattr__(self, item: str) -> Any:
        if item in ("_optimizer", "_session"):  # not set yet (copy/unpickle): do not recurse
            raise AttributeError(item)
        return getattr(self._session.optimizer, item)

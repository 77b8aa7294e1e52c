"""The optimizer for a loop that calls ``step()`` itself (Fabric's, or a plain torch one).

It is the user's optimizer with its step taken by the session, and with the engine's own state in its
state dict (under ``ENGINE_STATE_KEY``), so a checkpoint of it resumes the engine too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_zero_offload.core.session import ENGINE_STATE_KEY, OffloadSession
from lightning_zero_offload.engine import OffloadEngine, StepStats


class OffloadedOptimizer:
    """The user's optimizer with its step taken by the session: ``step``, ``zero_grad`` and the state go
    through it, for a loop that calls them itself (Fabric's, or a plain torch one).

    Imitates the wrapped optimizer's class (as Fabric's own wrapper does), so ``isinstance`` checks and
    LR schedulers work; ``param_groups`` are the wrapped optimizer's, which the engine reads live.
    ``state_dict()`` is what a checkpoint saves: torch AdamW's format (sharded: the param groups only,
    the moments are in the shards) plus the engine's state under :data:`ENGINE_STATE_KEY`.
    """

    def __init__(self, session: OffloadSession) -> None:
        self._session = session
        self._optimizer = session.engine.optimizer
        self.__class__ = type(
            "ZeroOffload" + self._optimizer.__class__.__name__, (OffloadedOptimizer, self._optimizer.__class__), {}
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> StepStats:
        if closure is not None:
            raise ValueError("zero_offload's optimizer.step() takes no closure: call backward before step()")
        self._training_engine()
        return self._session.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._session.zero_grad()
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        state = self._session.optimizer_state_to_save()
        state[ENGINE_STATE_KEY] = self._session.engine.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine = self._training_engine()
        engine.load_optimizer_state_dict(state_dict)
        if ENGINE_STATE_KEY in state_dict:
            engine.load_state_dict(state_dict[ENGINE_STATE_KEY])

    def _training_engine(self) -> OffloadEngine:
        if not self._session.training:
            raise RuntimeError("The offload engine is closed: training with this optimizer has ended")
        return self._session.engine

    def __getattr__(self, item: str) -> Any:
        if item == "_optimizer":  # not set yet (copy/unpickle): do not recurse
            raise AttributeError(item)
        return getattr(self._optimizer, item)

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
- ``state``: each parameter's ``step``, ``exp_avg`` and ``exp_avg_sq``, the moments as live views of the
  engine's CPU state (one rank; at several the moments are sharded and ``state`` refuses, naming the
  state-dict route instead). Deleting a parameter's entry (or ``state.clear()``) resets it as torch would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch

from lightning_zero_offload.checkpoints import ENGINE_STATE_KEY
from lightning_zero_offload.core.session import OffloadSession, training_session
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.step.cpu_state import MOMENTS


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


class ParamStates(MutableMapping):
    """``optimizer.state``: for each trainable parameter that has taken a step, its entry (below)."""

    def __init__(self, session: OffloadSession) -> None:
        if session.world_size != 1:
            raise RuntimeError(
                f"zero_offload shards the optimizer state across {session.world_size} ranks, so "
                "optimizer.state cannot show a parameter's moments whole. Read them with optimizer.state_dict() "
                "and change them with optimizer.load_state_dict() (both on every rank)."
            )
        engine = session.engine  # its CPU state, shown as torch's optimizer.state
        self._engine = engine
        self._index = {id(p): i for i, p in enumerate(engine.params)}

    def _position(self, param: Any) -> int:
        index = self._index.get(id(param))
        if index is None:
            raise KeyError(param)
        return index

    def __getitem__(self, param: Any) -> ParamState:
        return ParamState(self._engine, self._position(param))

    def __setitem__(self, param: Any, entry: Any) -> None:
        """``state[p] = {...}``: a reset when empty; otherwise each given entry is copied in."""
        state = self[param]
        if not entry:
            state.clear()
        for key, value in dict(entry).items():
            state[key] = value

    def __delitem__(self, param: Any) -> None:
        self[param].clear()

    def __iter__(self) -> Iterator[torch.nn.Parameter]:
        steps = self._engine.steps
        return iter([p for i, p in enumerate(self._engine.params) if steps[i] > 0])

    def __len__(self) -> int:
        return sum(step > 0 for step in self._engine.steps)

    def __contains__(self, param: object) -> bool:
        index = self._index.get(id(param))
        return index is not None and self._engine.steps[index] > 0


class ParamState(MutableMapping):
    """``optimizer.state[p]``: ``step`` (a float tensor, as torch keeps it; assign to change it), and
    ``exp_avg``/``exp_avg_sq`` as live views of the engine's moments (in-place changes are the engine's).
    Empty until the parameter's first step, as in torch; ``clear()`` resets the parameter."""

    def __init__(self, engine: OffloadEngine, index: int) -> None:
        self._engine, self._index = engine, index

    def _keys(self) -> tuple[str, ...]:
        return ("step", *MOMENTS) if self._engine.steps[self._index] > 0 else ()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys():
            raise KeyError(key)
        if key == "step":
            return torch.tensor(float(self._engine.steps[self._index]))
        return self._engine.moment_view(self._index, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "step":
            self._engine.set_param_step(self._index, int(value))
        elif key in MOMENTS:
            self._engine.set_moment(self._index, key, value)
        else:
            raise KeyError(f"zero_offload's Adam state holds step, exp_avg and exp_avg_sq, not {key!r}")

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"{key!r}: clear the parameter's whole state instead (del optimizer.state[p])")

    def clear(self) -> None:
        """The parameter starts again from zero moments and step 0, as torch's state for a new parameter."""
        self._engine.set_param_step(self._index, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

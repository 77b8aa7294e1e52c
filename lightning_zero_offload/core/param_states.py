"""``optimizer.state`` of the optimizer the front ends hand out: torch's mapping of each parameter that has taken a
step to its ``step``, ``exp_avg`` and ``exp_avg_sq``, over the engine's own state (live: an in-place change of a
moment is the engine's).

The state lies in one of two tables. The ZeRO-2 engine's: the trainable parameters' flat state (whole at one rank
only: at several ``state`` refuses and names the state-dict route), then the state it parked for parameters frozen
since they trained (engine/state_dicts.py), which torch keeps too. The offload_params engine's: its slots, whose
moments are shown as DTensors with their parameter's placement, as torch's AdamW keeps them under FSDP2 (at any
world size).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine
from lightning_zero_offload.engine.offload_params.sharded_state import as_dtensor
from lightning_zero_offload.engine.optimizer_support import optimizer_params
from lightning_zero_offload.engine.step.cpu_state import MOMENTS

if TYPE_CHECKING:
    from lightning_zero_offload.core.session_base import EngineSession


class StateTable(Protocol):
    """Each of ``params``' step count and moments, by its place in ``params``."""

    params: list[torch.nn.Parameter]

    def step(self, index: int) -> int: ...

    def set_step(self, index: int, step: int) -> None:
        """0: the parameter's state is reset (torch's fresh state)."""
        ...

    def moment(self, index: int, name: str) -> torch.Tensor:
        """A live view in the parameter's shape."""
        ...

    def set_moment(self, index: int, name: str, value: Any) -> None: ...


class FlatStateTable:
    """The ZeRO-2 engine's: its trainable parameters, then the frozen ones whose state it parked."""

    def __init__(self, engine: OffloadEngine, world_size: int) -> None:
        if world_size != 1:
            raise RuntimeError(
                f"zero_offload shards the optimizer state across {world_size} ranks, so "
                "optimizer.state cannot show a parameter's moments whole. Read them with optimizer.state_dict() "
                "and change them with optimizer.load_state_dict() (both on every rank)."
            )
        self._engine = engine
        self._trainable = len(engine.params)
        trainable = {id(p) for p in engine.params}
        parked = [p for p in optimizer_params(engine.optimizer) if id(p) not in trainable and engine.parked.entry(p)]
        self.params = [*engine.params, *parked]

    def _parked(self, index: int) -> dict[str, Any]:
        return self._engine.parked.entry(self.params[index])

    def step(self, index: int) -> int:
        if index < self._trainable:
            return self._engine.steps[index]
        return int(self._parked(index).get("step", 0))

    def set_step(self, index: int, step: int) -> None:
        if index < self._trainable:
            self._engine.set_param_step(index, step)
        elif step == 0:
            self._engine.parked.drop(self.params[index])
        else:
            self._engine.parked.park(self.params[index], "step", step)
            for name in MOMENTS:  # an entry given its step before its moments (or without): zero ones until then
                if name not in self._parked(index):
                    self.set_moment(index, name, 0.0)

    def moment(self, index: int, name: str) -> torch.Tensor:
        if index < self._trainable:
            return self._engine.moment_view(index, name)
        return self._parked(index)[name]

    def set_moment(self, index: int, name: str, value: Any) -> None:
        if index < self._trainable:
            self._engine.set_moment(index, name, value)
            return
        param = self.params[index]
        whole = torch.as_tensor(value).expand(param.shape)
        held = self._parked(index).get(name)
        if held is None:
            self._engine.parked.park(param, name, whole.to("cpu", self._engine.state.dtype, copy=True))
        else:
            held.copy_(whole)


class SlotTable:
    """The offload_params engine's: a slot per parameter that trained (frozen since, or not)."""

    def __init__(self, engine: ParamOffloadEngine) -> None:
        self._slots = engine.slots
        self.params = [slot.param for slot in self._slots]

    def step(self, index: int) -> int:
        return self._slots[index].step

    def set_step(self, index: int, step: int) -> None:
        slot = self._slots[index]
        if step == 0:
            slot.reset()
        slot.step = step

    def moment(self, index: int, name: str) -> torch.Tensor:
        slot = self._slots[index]
        return as_dtensor(getattr(slot, name), slot.param)

    def set_moment(self, index: int, name: str, value: Any) -> None:
        """A DTensor (this rank's part is taken) or a whole tensor (this rank's rows of it are)."""
        slot = self._slots[index]
        local = getattr(slot, name)
        if isinstance(value, DTensor):
            local.copy_(value.to_local())
        else:
            slot.load_rows(local, value)


def state_table(session: EngineSession) -> StateTable:
    engine = session.engine
    if isinstance(engine, ParamOffloadEngine):
        return SlotTable(engine)
    return FlatStateTable(engine, session.world_size)


class ParamStates(MutableMapping):
    """``optimizer.state``: for each parameter that has taken a step, its entry (below)."""

    def __init__(self, session: EngineSession) -> None:
        self._table = state_table(session)
        self._index = {id(p): i for i, p in enumerate(self._table.params)}

    def _position(self, param: Any) -> int:
        index = self._index.get(id(param))
        if index is None:
            raise KeyError(param)
        return index

    def __getitem__(self, param: Any) -> ParamState:
        return ParamState(self._table, self._position(param))

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
        table = self._table
        return iter([p for i, p in enumerate(table.params) if table.step(i) > 0])

    def __len__(self) -> int:
        return sum(self._table.step(i) > 0 for i in range(len(self._table.params)))

    def __contains__(self, param: object) -> bool:
        index = self._index.get(id(param))
        return index is not None and self._table.step(index) > 0


class ParamState(MutableMapping):
    """``optimizer.state[p]``: ``step`` (a float tensor, as torch keeps it; assign to change it), and
    ``exp_avg``/``exp_avg_sq`` as live views of the engine's moments (in-place changes are the engine's).
    Empty until the parameter's first step, as in torch; ``clear()`` resets the parameter."""

    def __init__(self, table: StateTable, index: int) -> None:
        self._table, self._index = table, index

    def _keys(self) -> tuple[str, ...]:
        return ("step", *MOMENTS) if self._table.step(self._index) > 0 else ()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys():
            raise KeyError(key)
        if key == "step":
            return torch.tensor(float(self._table.step(self._index)))
        return self._table.moment(self._index, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "step":
            self._table.set_step(self._index, int(value))
        elif key in MOMENTS:
            self._table.set_moment(self._index, key, value)
        else:
            raise KeyError(f"zero_offload's Adam state holds step, exp_avg and exp_avg_sq, not {key!r}")

    def __delitem__(self, key: str) -> None:
        raise KeyError(f"{key!r}: clear the parameter's whole state instead (del optimizer.state[p])")

    def clear(self) -> None:
        """The parameter starts again from zero moments and step 0, as torch's state for a new parameter."""
        self._table.set_step(self._index, 0)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

"""The planner: will a model fit, how fast will it train, and what should be set (docs/planning.md).

``plan(model_or_param_count, batch_size=, seq_len=, devices=, num_nodes=, machine=)`` returns a
:class:`Plan`; ``print(plan(...))`` shows it. ``measure_machine()`` measures this machine's rates;
``presets`` (:mod:`~lightning_zero_offload.planner.machine.presets`) has typical hosts and accelerators;
``largest_models(machine)`` says how large a model trains there without offload and with each ``cpu_state``.
"""

from lightning_zero_offload.planner.largest import LargestModels, largest_models
from lightning_zero_offload.planner.machine import Machine, measure_machine, presets, with_rates
from lightning_zero_offload.planner.model import plan
from lightning_zero_offload.planner.preflight import check_host_memory
from lightning_zero_offload.planner.report import Plan
from lightning_zero_offload.planner.timing import StepTime

__all__ = [
    "LargestModels",
    "Machine",
    "Plan",
    "StepTime",
    "check_host_memory",
    "largest_models",
    "measure_machine",
    "plan",
    "presets",
    "with_rates",
]

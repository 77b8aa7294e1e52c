"""The machine a plan is for: its rates (:mod:`.rates`), measured here by short probes (:mod:`.probes`) or
taken from typical hosts and accelerators (:mod:`.presets`)."""

from lightning_zero_offload.planner.machine import presets
from lightning_zero_offload.planner.machine.rates import GB, Machine, format_gb, measure_machine, with_rates

__all__ = ["GB", "Machine", "format_gb", "measure_machine", "presets", "with_rates"]

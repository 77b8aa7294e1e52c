"""The Trainer front end: Lightning's Trainer hooks translated into calls on the session (core/).

- :mod:`.strategy`: ``ZeroOffloadStrategy`` (setup, backward, evaluation, teardown);
- :mod:`.precision`: ``ZeroOffloadPrecision`` (the forward's autocast, the loss scale, the step after the
  closure, the hooks that see ``p.grad``);
- :mod:`.checkpoint_hooks`: the Trainer's checkpoint hooks, through core/checkpoint_io.py;
- :mod:`.ranks` and :mod:`.launchers`: DDP's processes and ranks without its wrapper;
- :mod:`.callbacks`: ``OffloadMetrics``.
"""

from lightning_zero_offload.trainer.callbacks import OffloadMetrics
from lightning_zero_offload.trainer.precision import ZeroOffloadPrecision
from lightning_zero_offload.trainer.strategy import ZeroOffloadStrategy

__all__ = ["OffloadMetrics", "ZeroOffloadPrecision", "ZeroOffloadStrategy"]

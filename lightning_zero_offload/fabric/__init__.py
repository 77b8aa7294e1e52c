"""The Fabric front end: ``L.Fabric(strategy="zero_offload")``, Fabric's hooks translated into calls on the
session (core/), as the Trainer's are.

- :mod:`.strategy`: ``ZeroOffloadFabricStrategy`` (setup, backward, clipping, checkpoints, teardown);
- :mod:`.precision`: ``ZeroOffloadFabricPrecision`` (the forward's autocast, the loss scale);
- :mod:`.checkpoints`: a Fabric checkpoint's freely named entries to and from the Trainer's layout;
- :mod:`.ranks`: Fabric's DDP machinery without its wrapper.
"""

from lightning_zero_offload.fabric.precision import ZeroOffloadFabricPrecision
from lightning_zero_offload.fabric.strategy import ZeroOffloadFabricStrategy

__all__ = ["ZeroOffloadFabricPrecision", "ZeroOffloadFabricStrategy"]

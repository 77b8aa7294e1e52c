"""The entries this package adds to a Lightning checkpoint, by key.

- ``ENGINE_STATE_KEY``: the engine's own state (step count, loss scale, the schedule's pending state): a
  top-level entry of a Trainer checkpoint, an entry of the optimizer state in a Fabric one;
- ``FABRIC_KEY``: which of a Fabric checkpoint's freely named entries hold the model's state dict (and,
  sharded, the optimizer's), e.g. ``{"model": "model", "optimizer": "optimizer"}``;
- ``FORMAT_KEY``: a sharded checkpoint's layout, in its ``meta.pt`` (:mod:`.sharded`).
"""

ENGINE_STATE_KEY = "zero_offload_engine"
FABRIC_KEY = "zero_offload_fabric"
FORMAT_KEY = "zero_offload"

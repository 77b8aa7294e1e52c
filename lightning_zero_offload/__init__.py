"""ZeRO-Offload for PyTorch Lightning.

Importing the package registers the ``"zero_offload"`` strategy name, so that
``Trainer(strategy="zero_offload")``, ``Fabric(strategy="zero_offload")`` and
``trainer.strategy: zero_offload`` in LightningCLI YAML work.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry

from lightning_zero_offload.callbacks import OffloadMetrics
from lightning_zero_offload.engine.checkpoint import CheckpointError, convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.engine.failures import NonFiniteLossError
from lightning_zero_offload.engine.model_checks import ModelMismatchError
from lightning_zero_offload.fabric import ZeroOffloadFabricStrategy
from lightning_zero_offload.fabric_precision import ZeroOffloadFabricPrecision
from lightning_zero_offload.optim import CPUAdam
from lightning_zero_offload.planner import plan
from lightning_zero_offload.precision import ZeroOffloadPrecision
from lightning_zero_offload.strategy import ZeroOffloadStrategy

ZeroOffloadStrategy.register_strategies(StrategyRegistry)
ZeroOffloadFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)

__all__ = [
    "CheckpointError",
    "CPUAdam",
    "ModelMismatchError",
    "NonFiniteLossError",
    "OffloadMetrics",
    "ZeroOffloadFabricPrecision",
    "ZeroOffloadFabricStrategy",
    "ZeroOffloadPrecision",
    "ZeroOffloadStrategy",
    "convert_checkpoint_to_fp32_state_dict",
    "plan",
]

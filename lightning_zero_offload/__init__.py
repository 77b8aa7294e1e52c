"""ZeRO-Offload for PyTorch Lightning.

Importing the package registers the ``"zero_offload"`` strategy name, so that
``Trainer(strategy="zero_offload")``, ``Fabric(strategy="zero_offload")`` and
``trainer.strategy: zero_offload`` in LightningCLI YAML work.

The engine, the kernels, the checkpoint formats, the planner and ``CPUAdam`` need torch alone: where
Lightning cannot be imported, the package imports without its two front ends (``trainer/``, ``fabric/``)
and registers nothing.
"""

from lightning_zero_offload.checkpoints import (
    CheckpointError,
    convert_checkpoint_to_fp32_state_dict,
    export_hugging_face,
    save_hugging_face,
)
from lightning_zero_offload.core.model_rules import ModelMismatchError
from lightning_zero_offload.engine.failures import NonFiniteLossError
from lightning_zero_offload.engine.offload_params.pretrained import load_pretrained
from lightning_zero_offload.optim import CPUAdam
from lightning_zero_offload.planner import plan

__all__ = [
    "CheckpointError",
    "CPUAdam",
    "ModelMismatchError",
    "NonFiniteLossError",
    "convert_checkpoint_to_fp32_state_dict",
    "export_hugging_face",
    "load_pretrained",
    "plan",
    "save_hugging_face",
]

try:
    import lightning  # noqa: F401
except ImportError:  # torch alone: no front end to register
    pass
else:
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zero_offload.fabric import ZeroOffloadFabricPrecision, ZeroOffloadFabricStrategy
    from lightning_zero_offload.trainer import OffloadMetrics, ZeroOffloadPrecision, ZeroOffloadStrategy

    ZeroOffloadStrategy.register_strategies(StrategyRegistry)
    ZeroOffloadFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)
    __all__ += [
        "OffloadMetrics",
        "ZeroOffloadFabricPrecision",
        "ZeroOffloadFabricStrategy",
        "ZeroOffloadPrecision",
        "ZeroOffloadStrategy",
    ]

"""The Trainer's process launchers: Lightning's own, remembering the ``weights_only`` given to ``fit``.

Lightning drops ``weights_only`` before ``load_checkpoint`` for strategies that restore after setup (as
this one must: the optimizer state lives in the engine that setup builds), and 2.4/2.5 have no such
argument; the launchers keep it on the strategy for trainer/checkpoint_hooks.py.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher


class _RemembersWeightsOnly:
    """Keeps the ``weights_only`` given to ``fit``/``validate``/... on the strategy.

    Lightning drops it before ``load_checkpoint`` for strategies that restore after setup (as this one
    must: the optimizer state lives in the engine that setup builds), and 2.4/2.5 have no such argument.
    """

    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if trainer is not None:
            try:
                bound = inspect.signature(function).bind_partial(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            trainer.strategy._weights_only = bound.get("weights_only")
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class SubprocessScriptLauncher(_RemembersWeightsOnly, _SubprocessScriptLauncher):
    """Lightning's script launcher (``start_method="popen"``), remembering ``weights_only``."""


class MultiProcessingLauncher(_RemembersWeightsOnly, _MultiProcessingLauncher):
    """Lightning's multiprocessing launcher (spawn/fork), remembering ``weights_only``."""

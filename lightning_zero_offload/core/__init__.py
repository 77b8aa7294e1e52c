"""The core both front ends share: plain torch and the engine, no Trainer and no Fabric.

:mod:`.options` holds what they take (options, precision, timeout, validated once); :mod:`.session`
what they do, the one door to the engine (build it, the backward window, the pending clip, the step,
``zero_grad``, what the engine did), with :mod:`.session_checkpoints` its state dicts and saves;
:mod:`.optimizer` the optimizer for a loop that steps itself; :mod:`.gradients` what
``p.grad`` says; :mod:`.checkpoint_io` the one checkpoint path of both front ends; :mod:`.model_rules` the
models the engine refuses; :mod:`.teardown` the end of a run. ``trainer/`` and ``fabric/`` translate
Lightning's hooks into it.
"""

from lightning_zero_offload.core.optimizer import OffloadedOptimizer
from lightning_zero_offload.core.options import (
    OPTION_NAMES,
    OPTIONS_DOC,
    STRATEGY_DESCRIPTION,
    coerced_precision,
    collective_timeout,
    make_offload_options,
    resolve_precision,
)
from lightning_zero_offload.core.session import (
    ENGINE_STATE_KEY,
    OffloadSession,
    SessionStrategy,
    all_gather_objects,
    move_untrained_to,
    training_session,
)
from lightning_zero_offload.core.teardown import release_after_failure, release_process_group

__all__ = [
    "ENGINE_STATE_KEY",
    "OPTIONS_DOC",
    "OPTION_NAMES",
    "STRATEGY_DESCRIPTION",
    "OffloadSession",
    "OffloadedOptimizer",
    "SessionStrategy",
    "all_gather_objects",
    "coerced_precision",
    "collective_timeout",
    "make_offload_options",
    "move_untrained_to",
    "release_after_failure",
    "release_process_group",
    "resolve_precision",
    "training_session",
]

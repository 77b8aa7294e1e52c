"""The core both front ends share: plain torch and the engine, no Trainer and no Fabric.

:mod:`.meta_device` builds on the meta device; :mod:`.options` holds what they take (options, precision, timeout,
validated once); :mod:`.session`
what they do, the one door to the engine (build it, the backward window, the pending clip, the step,
``zero_grad``, what the engine did), with :mod:`.session_checkpoints` its state dicts and saves, and
:mod:`.param_session` the same door for ``offload_params=True`` (what both answer alike: :mod:`.session_base`);
:mod:`.optimizer` the optimizer for a loop that steps itself; :mod:`.gradients` what
``p.grad`` says; :mod:`.checkpoint_io` the one checkpoint path of both front ends; :mod:`.model_rules` the
models the engine refuses; :mod:`.teardown` the end of a run. ``trainer/`` and ``fabric/`` translate
Lightning's hooks into it and import nothing from the engine: what it did reaches them as its
:class:`StepStats` (with :func:`hidden_fraction`), re-exported here.
"""

from lightning_zero_offload.core.meta_device import built_on_meta
from lightning_zero_offload.core.optimizer import OffloadedOptimizer
from lightning_zero_offload.core.options import (
    OPTION_NAMES,
    OPTIONS_DOC,
    coerced_precision,
    collective_timeout,
    make_offload_options,
    resolve_precision,
)
from lightning_zero_offload.core.param_session import ParamOffloadSession
from lightning_zero_offload.core.session import (
    ENGINE_STATE_KEY,
    BlockwiseInit,
    OffloadSession,
    SessionStrategy,
    materialize,
    move_untrained_to,
    on_meta,
    training_session,
)
from lightning_zero_offload.core.teardown import release_after_failure, release_process_group
from lightning_zero_offload.engine.stats import StepStats, hidden_fraction

__all__ = [
    "ENGINE_STATE_KEY",
    "BlockwiseInit",
    "OPTIONS_DOC",
    "OPTION_NAMES",
    "OffloadSession",
    "ParamOffloadSession",
    "OffloadedOptimizer",
    "SessionStrategy",
    "StepStats",
    "built_on_meta",
    "coerced_precision",
    "collective_timeout",
    "hidden_fraction",
    "make_offload_options",
    "materialize",
    "move_untrained_to",
    "on_meta",
    "release_after_failure",
    "release_process_group",
    "resolve_precision",
    "training_session",
]

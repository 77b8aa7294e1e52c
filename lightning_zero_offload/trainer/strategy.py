"""``ZeroOffloadStrategy``: ZeRO-Offload (and ZeRO-2 across ranks) behind Lightning's unchanged Trainer loop.

Lightning glue only: the Trainer's hooks as calls on an :class:`~lightning_zero_offload.core.OffloadSession`
(built in ``setup`` from the optimizer that ``configure_optimizers`` returns), the core the Fabric strategy
shares. The step itself is taken by :class:`~lightning_zero_offload.trainer.precision.ZeroOffloadPrecision`;
processes and ranks are DDP's without its wrapper (:mod:`lightning_zero_offload.trainer.ranks`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer, callbacks
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_zero_offload.core import (
    OPTION_NAMES,
    OPTIONS_DOC,
    BlockwiseInit,
    OffloadedOptimizer,
    OffloadSession,
    ParamOffloadSession,
    SessionStrategy,
    built_on_meta,
    coerced_precision,
    collective_timeout,
    make_offload_options,
    materialize,
    on_meta,
    release_after_failure,
    training_session,
)
from lightning_zero_offload.trainer.callbacks import OffloadMetrics
from lightning_zero_offload.trainer.checkpoint_hooks import TrainerCheckpoints, fitting
from lightning_zero_offload.trainer.precision import ZeroOffloadPrecision
from lightning_zero_offload.trainer.ranks import ParallelLikeDDP

__all__ = ["ZeroOffloadStrategy"]

# Lightning's weight-averaging callbacks keep a whole unsharded copy of the module (WeightAveraging: Lightning 2.6+).
WEIGHT_AVERAGING = tuple(
    getattr(callbacks, name) for name in ("StochasticWeightAveraging", "WeightAveraging") if hasattr(callbacks, name)
)


class ZeroOffloadStrategy(SessionStrategy, TrainerCheckpoints, ParallelLikeDDP):
    __doc__ = f"""Low-precision params, forward and backward on the device; fp32 master weights and Adam on the CPU.

    Args:
{OPTIONS_DOC}        metrics: add the :class:`~lightning_zero_offload.OffloadMetrics` callback (per-step time
            breakdown, gradient norm and loss scale as ``offload/*`` metrics, and a summary at the end of fit).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        bucket_size_mb: float = 25.0,
        pin_memory: bool = True,
        overlap: bool | None = None,
        cpu_threads: int | None = None,
        cpu_step: Literal["auto", "sync", "speculative", "delayed"] = "auto",
        cpu_state: Literal["fp32", "bf16"] = "fp32",
        speculation_rollback: Literal["auto", "undo", "snapshot"] = "auto",
        loss_scale_init: float = 2.0**16,
        loss_scale_growth_interval: int = 1000,
        loss_scale_growth_factor: float = 2.0,
        loss_scale_backoff_factor: float = 0.5,
        loss_scale_hysteresis: int = 2,
        loss_scale_min: float = 1.0,
        dpu_warmup_steps: int = 40,
        dpu_weight_prediction: bool = False,
        checkpoint_format: Literal["full", "sharded"] = "full",
        metrics: bool = True,
        max_consecutive_skipped_steps: int | None = 20,
        in_place_on_cpu: bool | None = None,
        offload_params: bool = False,
        device_share: float | Literal["auto"] = 0.0,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        # Every offload option above, by name, validated in one place for both front ends.
        self.options = make_offload_options(**{name: value for name, value in locals().items() if name in OPTION_NAMES})
        super().__init__(
            process_group_backend,
            collective_timeout(timeout),
            start_method,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.metrics = metrics
        self.needs_process_group = self.options.offload_params
        self.session: OffloadSession | ParamOffloadSession | None = None
        self._setup_error: BaseException | None = None  # what setup refused, which teardown must not replace
        self._failed = False  # a step or hook raised: teardown must not replace that error either
        self._blockwise: BlockwiseInit | None = None  # during setup: the placeholders of a model built on meta

    # Lightning assigns a generic plugin built from `precision=`; the offload step needs this one.
    precision_plugin = coerced_precision(ZeroOffloadPrecision, "_precision_plugin")  # type: ignore[assignment]

    @override
    def setup(self, trainer: Trainer) -> None:
        self._setup_error, self._failed, earlier = None, False, self.session
        try:
            self._setup(trainer)
        except BaseException as error:
            self._setup_error = error  # see teardown
            if self._blockwise is not None and self.session is earlier:  # no engine took the placeholders
                self._blockwise.undo()  # the module is on the meta device again, not the placeholders' zeros
            raise
        finally:
            self._blockwise = None

    def _setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device_type = self.root_device.type
        module = self.lightning_module
        assert module is not None
        precision, world = self.precision_plugin.precision, self.num_nodes * self.num_processes
        if fitting(trainer) and self._layer_sync:
            raise ValueError("zero_offload does not support sync_batchnorm=True")
        if self.options.offload_params:
            if fitting(trainer):
                refuse_weight_averaging(trainer)
                refuse_narrow_frozen_parameters(trainer, module, self.options.cpu_state)
            # FSDP2 replaces the parameters: shard before configure_optimizers builds the optimizer over them.
            ParamOffloadSession.shard(module, self.root_device, precision, self.options, world, self.num_processes)
            if not fitting(trainer):  # evaluation after a fit gathers in the compute dtype again, not fp32
                ParamOffloadSession.gather_for_stage(module, running=True)
        if not self.options.offload_params and on_meta(module, partly=True):
            if fitting(trainer):  # placeholders for configure_optimizers, filled block by block by the engine
                self._blockwise = OffloadSession.placeholders(module, self.root_device)
            else:
                materialize(module, self.root_device)  # evaluation only: whole on the device
        if fitting(trainer):
            start = ParamOffloadSession.start if self.options.offload_params else OffloadSession.start
            self.setup_optimizers(trainer)
            if any(isinstance(optimizer, _MockOptimizer) for optimizer in self.optimizers):
                raise ValueError(
                    "zero_offload trains with the optimizer that configure_optimizers returns, and it returned None. "
                    "Return a torch.optim.AdamW/Adam (or lightning_zero_offload.CPUAdam) over self.parameters()."
                )
            extra = {} if self.options.offload_params else {"blockwise": self._blockwise}
            self.session = start(
                module, self.optimizers, self.root_device, precision, self.options, world, self.num_processes, **extra
            )
            self.precision_plugin.attach(self.session)
            # The optimizer Lightning and users hold from now on: its step, zero_grad and state are the engine's.
            self.optimizers = [OffloadedOptimizer(self.session)]
            if self.metrics and not any(isinstance(c, OffloadMetrics) for c in trainer.callbacks):
                trainer.callbacks.append(OffloadMetrics())
        if not self.options.offload_params:  # FSDP2 has put the buffers on the device, the shards on the host
            self.model_to_device()
        self.setup_precision_plugin()

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: setup materializes the model unit
        by unit, into its shards with parameters offloaded, else into the engine's master weights (never whole
        on the host or the device). Without it, with parameters offloaded, the model is built on the host."""
        if not self.options.offload_params and not empty_init:
            with super().tensor_init_context(empty_init):
                yield
            return
        with built_on_meta() if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device, as under ``init_module(empty_init=True)`` (a load into
        the model before setup materializes it first: core/meta_device.py)."""
        with built_on_meta():
            yield

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """A LightningModule step through the module's ``__call__``, where FSDP2 gathers the root's own parameters
        (Lightning's forward redirection, as its FSDP strategy routes steps through the wrapper)."""
        assert self.lightning_module is not None
        with context:
            module = self.lightning_module
            return self._forward_redirection(module, module, name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.options.offload_params:
            return super().training_step(*args, **kwargs)
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.options.offload_params:
            return super().validation_step(*args, **kwargs)
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.options.offload_params:
            return super().test_step(*args, **kwargs)
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.options.offload_params:
            return super().predict_step(*args, **kwargs)
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: release the engine and the process group without a collective (the other
        ranks then fail at once instead of at the collective timeout)."""
        self._failed = True
        release_after_failure(self.session, self.is_distributed)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if (session := training_session(self.session)) is not None:
            session.begin_backward()

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if (session := training_session(self.session)) is not None:
            session.finish_backward()

    @override
    def on_validation_start(self) -> None:
        self.sync()  # evaluation sees fully updated parameters, also with a delayed update
        if self.options.offload_params and self.world_size > 1:
            assert self.lightning_module is not None
            refuse_uneven_batches(self.lightning_module.trainer, self)

    on_test_start = on_predict_start = on_validation_start

    @override
    def teardown(self) -> None:
        if self.session is not None:
            # Hand the module back holding the trained fp32 master weights; the CPU optimizer state stays
            # with the closed engine so `trainer.save_checkpoint` after fit still saves it.
            self.session.close()
        module = self.lightning_module
        if self.options.offload_params and isinstance(module, FSDPModule) and not self._failed:
            ParamOffloadSession.gather_for_stage(module, running=False)  # an evaluation stage ends: fp32 for calls
        # Lightning's teardown moves optimizer state to the CPU through optimizer.state; the engine's is there
        # already (and at several ranks optimizer.state refuses: the moments are sharded).
        optimizers, self._optimizers = self._optimizers, []
        try:
            super().teardown()
        except Exception:
            # What setup refused (the pre-flight, a model nothing can initialize), or what a step raised, is what
            # the user must fix; a module that cannot move back (one on the meta device: "Cannot copy out of meta
            # tensor"; FSDP2's units left gathered by a forward that raised) must not take its place.
            if self._setup_error is not None:
                raise self._setup_error from None
            if not self._failed:
                raise
        finally:
            self._optimizers = optimizers


def refuse_uneven_batches(trainer: Trainer, strategy: ParallelLikeDDP) -> None:
    """``offload_params`` gathers each unit's parameters from every rank in each forward (FSDP2), so an evaluation
    loop must run as many batches on every rank: a rank that ran out would leave the others waiting in an
    all-gather (a hang, or gloo's "Connection closed by peer"). Lightning's predict sampler does not pad, nor does
    a sampler of the user's. Compared before the first batch (one all-gather per loop)."""
    stage, counts = next(
        (stage, counts)
        for stage, counts, now in (
            ("predict", trainer.num_predict_batches, trainer.predicting),
            ("test", trainer.num_test_batches, trainer.testing),
            ("val", trainer.num_sanity_val_batches, trainer.sanity_checking),
            ("val", trainer.num_val_batches, True),
        )
        if now
    )
    if not counts:  # no dataloader: Lightning skips the loop on every rank
        return
    mine = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=strategy.root_device)
    every = strategy.all_gather(mine).reshape(strategy.world_size, -1).cpu()
    if every.isinf().any() or (every == every[0]).all():
        return  # an iterable without a length cannot be counted ahead
    per_rank = ", ".join(f"rank {r}: {[int(c) for c in row]}" for r, row in enumerate(every.tolist()))
    raise ValueError(
        f"offload_params=True: this {stage} loop would run a different number of batches per rank ({per_rank}, per "
        "dataloader), and FSDP2 gathers each block's parameters from every rank in each forward, so a rank that ran "
        "out would leave the others waiting. Lightning's predict sampler pads nothing, nor does a sampler of your "
        "own. Fix: make the dataset's length a multiple of world_size x batch_size (pad it), or set "
        f"limit_{stage}_batches to the smallest count, or run it with offload_params=False (the ZeRO-2 mode runs "
        "uneven batches as DDP does)."
    )


def refuse_weight_averaging(trainer: Trainer) -> None:
    """``offload_params`` shards the parameters; Lightning's weight averaging averages them into an unsharded copy
    of the whole module on the device (and fails there: "aten.copy_.default got mixed torch.Tensor and DTensor").
    Lightning's FSDP and DeepSpeed strategies refuse ``StochasticWeightAveraging`` so."""
    for callback in trainer.callbacks:
        if isinstance(callback, WEIGHT_AVERAGING):
            raise ValueError(
                f"{type(callback).__name__} keeps an unsharded copy of the whole model on the device and averages "
                "the parameters into it, and offload_params=True shards them (FSDP2) to keep the model off the "
                "device. Fix: train with offload_params=False, where weight averaging works as under "
                "strategy='auto', or remove the callback (Lightning's FSDP and DeepSpeed strategies refuse "
                "StochasticWeightAveraging for the same reason)."
            )


def refuse_narrow_frozen_parameters(trainer: Trainer, module: torch.nn.Module, cpu_state: str) -> None:
    """A finetuning callback will unfreeze parameters frozen now; with fp32 state a frozen one built in bf16/fp16
    keeps that dtype when sharded (its storage), and its shard cannot become an fp32 master later: refused now, not
    an epoch into the run."""
    if cpu_state == "bf16" or not any(isinstance(c, callbacks.BaseFinetuning) for c in trainer.callbacks):
        return
    frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad and p.is_floating_point()]
    narrow = next(((n, p.dtype) for n, p in frozen if p.dtype.itemsize < 4), None)
    if narrow is not None:
        raise ValueError(
            f"a finetuning callback will unfreeze parameters that are frozen now, and {narrow[0]!r} is "
            f"{narrow[1]}: with offload_params=True a parameter frozen when the "
            "model is sharded keeps the dtype it was built in, and fp32 master weights cannot be made of its shard "
            "later. Build the model in float32 (model.float()), or set cpu_state='bf16', or use offload_params=False"
        )

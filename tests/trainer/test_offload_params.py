"""``ZeroOffloadStrategy(offload_params=True)`` in the Trainer against ``strategy="auto"`` (torch AdamW)."""

from __future__ import annotations

import pathlib
from contextlib import nullcontext

import lightning as L
import pytest
import torch
from helpers import QUIET, BlockRegression, BlockRegressionInConfigureModel, CausalLM, block_data
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging, WeightAveraging
from offload_params_helpers import relative_error, tiny_llama_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy, convert_checkpoint_to_fp32_state_dict, load_pretrained
from lightning_zero_offload.checkpoints import CheckpointError

FP32_ROUNDING = 1e-6  # normwise; observed below 2e-7 (the kernel's rounding and the clip norm's)


pytestmark = pytest.mark.usefixtures("own_process_group")  # conftest.py


def fit(strategy, **trainer_args) -> dict[str, torch.Tensor]:
    module = BlockRegression()
    trainer = L.Trainer(strategy=strategy, max_steps=5, **{**QUIET, **trainer_args})
    trainer.fit(module, block_data(96))
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for name, p in module.model.named_parameters()
    }


@pytest.mark.parametrize("clip", [None, 0.3])
def test_equals_auto_with_accumulation_clipping_groups_and_a_scheduler(clip):
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": clip}
    want = fit("auto", **arguments)
    got = fit(ZeroOffloadStrategy(offload_params=True, cpu_step="sync"), **arguments)
    assert relative_error(got, want) < FP32_ROUNDING


def test_bf16_mixed_equals_auto_bf16_mixed():
    """fp16 needs a GPU under strategy='auto' (Lightning runs bf16 for '16-mixed' on a CPU); the engine's tests
    cover fp16 loss scaling."""
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3, "precision": "bf16-mixed"}
    want = fit("auto", **arguments)
    assert relative_error(fit(ZeroOffloadStrategy(offload_params=True), **arguments), want) < FP32_ROUNDING
    # bf16 master weights and moments, stochastically rounded: observed 7.2e-3
    compact = fit(ZeroOffloadStrategy(offload_params=True, cpu_state="bf16"), **arguments)
    assert relative_error(compact, want) < 1.5e-2


def test_speculative_equals_sync_bitwise_in_the_trainer():
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3}
    sync = fit(ZeroOffloadStrategy(offload_params=True, cpu_step="sync"), **arguments)
    speculated = fit(ZeroOffloadStrategy(offload_params=True, cpu_step="speculative"), **arguments)
    assert all(torch.equal(speculated[k], sync[k]) for k in sync)


class MomentSurgery(L.Callback):
    """A user resets the optimizer through ``optimizer.state`` (test_torch_contracts.py's, on the blocks): moments
    changed in place at step 2, new ones assigned at 3 (whole tensors, as under auto), an entry deleted at 4."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = trainer.optimizers[0].state
        if trainer.global_step == 2:
            self.moment_types = {type(entry["exp_avg"]) for entry in state.values()}
            for entry in state.values():
                entry["exp_avg"].zero_()
                entry["exp_avg_sq"].mul_(0.5)
        if trainer.global_step == 3:
            for p in pl_module.model.blocks[0].parameters():
                state[p]["exp_avg_sq"] = torch.full(p.shape, 1e-4)
        if trainer.global_step == 4:
            del state[pl_module.model.head.weight]


def test_the_optimizer_state_is_the_engines_moments_as_fsdp2_shows_them():
    """``optimizer.state[p]``: the step and the moments as DTensors with the parameter's placement (as torch's AdamW
    keeps them under FSDP2), live: changing them changes the training as it does under auto."""
    want = fit("auto", callbacks=[MomentSurgery()])
    surgery = MomentSurgery()
    assert relative_error(fit(ZeroOffloadStrategy(offload_params=True), callbacks=[surgery]), want) < FP32_ROUNDING
    assert surgery.moment_types == {DTensor}
    assert relative_error(fit(ZeroOffloadStrategy(offload_params=True)), want) > 1e-3  # the surgery changes it


def test_the_registered_name_offloads_the_parameters():
    module = BlockRegression()
    trainer = L.Trainer(strategy="zero_offload_params", max_steps=1, **QUIET)
    trainer.fit(module, block_data(96))
    assert trainer.strategy.session.engine.resolved.offload_params
    assert type(module.model.blocks[0].fc1.weight).__name__ == "DTensor"


def fit_to(strategy, tmp_path, max_steps, ckpt_path=None, save=None, precision="32-true") -> dict[str, torch.Tensor]:
    module = BlockRegression()
    arguments = {**QUIET, "default_root_dir": tmp_path, "precision": precision}
    trainer = L.Trainer(strategy=strategy, max_steps=max_steps, **arguments)
    trainer.fit(module, block_data(24), ckpt_path=ckpt_path)  # 3 steps an epoch: resumes at an epoch's end
    if save is not None:
        trainer.save_checkpoint(save)
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for name, p in module.model.named_parameters()
    }


def resumed(strategy, tmp_path, name) -> dict[str, torch.Tensor]:
    """3 steps, trainer.save_checkpoint, then a new fit resumed from it to 6 (Lightning's own resume, which
    differs from an uninterrupted run of 6 under strategy='auto' too: the comparisons are between resumes)."""
    fit_to(strategy(), tmp_path, 3, save=tmp_path / name)
    return fit_to(strategy(), tmp_path, 6, ckpt_path=tmp_path / name)


def test_a_resumed_fit_equals_auto_resumed_and_speculative_equals_sync_bitwise(tmp_path):
    want = resumed(lambda: "auto", tmp_path, "auto.ckpt")
    sync = resumed(lambda: ZeroOffloadStrategy(offload_params=True, cpu_step="sync"), tmp_path, "sync.ckpt")
    speculated = resumed(lambda: ZeroOffloadStrategy(offload_params=True, cpu_step="speculative"), tmp_path, "s.ckpt")
    assert relative_error(sync, want) < FP32_ROUNDING
    assert all(torch.equal(speculated[k], sync[k]) for k in sync)
    saved = torch.load(tmp_path / "sync.ckpt", weights_only=True)
    assert saved["state_dict"]["model.blocks.0.fc1.weight"].shape == (32, 16)  # whole, not a shard
    exported = convert_checkpoint_to_fp32_state_dict(tmp_path / "sync.ckpt")  # what zero-offload-convert writes
    assert all(torch.equal(exported[k], v) for k, v in saved["state_dict"].items())


def test_the_full_checkpoint_resumes_with_parameters_on_the_device_too(tmp_path):
    """Full checkpoints are the ZeRO-2 mode's format: either mode resumes from the other's."""
    fit_to(ZeroOffloadStrategy(offload_params=True), tmp_path, 3, save=tmp_path / "params.ckpt")
    fit_to(ZeroOffloadStrategy(in_place_on_cpu=False), tmp_path, 3, save=tmp_path / "zero2.ckpt")
    ours = fit_to(ZeroOffloadStrategy(offload_params=True), tmp_path, 6, ckpt_path=tmp_path / "params.ckpt")
    crossed = fit_to(ZeroOffloadStrategy(in_place_on_cpu=False), tmp_path, 6, ckpt_path=tmp_path / "params.ckpt")
    back = fit_to(ZeroOffloadStrategy(offload_params=True), tmp_path, 6, ckpt_path=tmp_path / "zero2.ckpt")
    assert relative_error(crossed, ours) < FP32_ROUNDING
    assert relative_error(back, ours) < FP32_ROUNDING


def test_the_sharded_checkpoint_is_read_whole_where_no_shards_await_it(tmp_path):
    """The ZeRO-2 mode resumes from offload_params' sharded (DCP) checkpoint as from its full one, bitwise the
    offload_params resume (it was refused); a fresh Trainer validates from it (refused too, naming offload_params=True
    as the way, which it was), the shards filled from it."""
    sharded = ZeroOffloadStrategy(offload_params=True, checkpoint_format="sharded")
    fit_to(sharded, tmp_path, 3, save=tmp_path / "dcp.ckpt")
    ours = fit_to(ZeroOffloadStrategy(offload_params=True), tmp_path, 6, ckpt_path=tmp_path / "dcp.ckpt")
    crossed = fit_to(ZeroOffloadStrategy(in_place_on_cpu=False), tmp_path, 6, ckpt_path=tmp_path / "dcp.ckpt")
    assert all(torch.equal(crossed[k], v) for k, v in ours.items())
    module = Evaluated()
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(offload_params=True), **QUIET)
    trainer.validate(module, block_data(8), ckpt_path=tmp_path / "dcp.ckpt", verbose=False)
    saved = convert_checkpoint_to_fp32_state_dict(tmp_path / "dcp.ckpt")
    assert all(torch.equal(p.full_tensor(), saved[f"model.{k}"]) for k, p in module.model.named_parameters())


def test_evaluating_another_module_from_a_sharded_checkpoint_after_fit_loads_into_that_module(tmp_path):
    """validate/predict(another_module, ckpt_path=...) (test alike) on the Trainer that just fit: the checkpoint
    went into the fitted module (through the ended fit's session), and the other module was evaluated as built,
    as under auto it is not: the numbers were those of an untrained model, silently."""
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(offload_params=True, checkpoint_format="sharded"), max_steps=3, **QUIET
    )
    fitted = Evaluated()
    trainer.fit(fitted, block_data(24))
    trainer.save_checkpoint(tmp_path / "dcp.ckpt")
    trained = fit_weights(fitted)
    saved = convert_checkpoint_to_fp32_state_dict(tmp_path / "dcp.ckpt")
    for evaluate in (trainer.validate, trainer.predict):
        other = Evaluated()
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)  # unlike the checkpoint wherever it is not loaded
        kwargs = {"verbose": False} if evaluate.__name__ == "validate" else {}
        evaluate(other, block_data(8), ckpt_path=tmp_path / "dcp.ckpt", **kwargs)
        assert all(torch.equal(p.full_tensor(), saved[f"model.{k}"]) for k, p in other.model.named_parameters())
        assert all(torch.equal(v, trained[k]) for k, v in fit_weights(fitted).items())  # untouched


@pytest.mark.parametrize("cpu_state", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_sharded_checkpoints_resume_as_the_full_format_does(cpu_state, tmp_path):
    """checkpoint_format='sharded': every rank saves its shards through torch.distributed.checkpoint; the resumed
    run equals the one resumed from the full format bitwise (the same loop state, the same weights and moments)."""
    precision = "bf16-mixed" if cpu_state == "bf16" else "32-true"
    made = {
        fmt: lambda fmt=fmt: ZeroOffloadStrategy(offload_params=True, checkpoint_format=fmt, cpu_state=cpu_state)
        for fmt in ("full", "sharded")
    }
    runs = {}
    for fmt, strategy in made.items():
        fit_to(strategy(), tmp_path, 3, save=tmp_path / fmt, precision=precision)
        runs[fmt] = fit_to(strategy(), tmp_path, 6, ckpt_path=tmp_path / fmt, precision=precision)
    assert (tmp_path / "sharded").is_dir()
    assert all(torch.equal(runs["sharded"][k], v) for k, v in runs["full"].items())
    exported = convert_checkpoint_to_fp32_state_dict(tmp_path / "sharded")  # streamed, tensor by tensor
    assert sorted(exported) == sorted(torch.load(tmp_path / "full", weights_only=True)["state_dict"])


class BlockRegressionWithPath(BlockRegression):
    def __init__(self, where: pathlib.Path = pathlib.Path("/data/run")) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_fit_weights_only_false_is_honoured_by_the_sharded_format(tmp_path):
    """Hyperparameters holding a pathlib.Path need fit(weights_only=False), as with strategy="auto" (the DCP
    checkpoint's meta.pt read it as weights_only whatever fit was given)."""
    strategy = lambda: ZeroOffloadStrategy(offload_params=True, checkpoint_format="sharded")  # noqa: E731
    trainer = L.Trainer(strategy=strategy(), max_steps=3, **QUIET)
    trainer.fit(BlockRegressionWithPath(), block_data(24))
    trainer.save_checkpoint(tmp_path / "p.ckpt")
    resumed = L.Trainer(strategy=strategy(), max_steps=6, **QUIET)
    with pytest.raises(CheckpointError, match="refused by weights_only loading"):
        resumed.fit(BlockRegressionWithPath(), block_data(24), ckpt_path=tmp_path / "p.ckpt")
    resumed = L.Trainer(strategy=strategy(), max_steps=6, **QUIET)
    resumed.fit(BlockRegressionWithPath(), block_data(24), ckpt_path=tmp_path / "p.ckpt", weights_only=False)
    assert resumed.global_step == 6


def test_a_model_built_in_configure_model_trains_as_the_eager_one():
    want = fit("auto", accumulate_grad_batches=2)
    module = BlockRegressionInConfigureModel()
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(offload_params=True), max_steps=5, accumulate_grad_batches=2, **QUIET
    )
    trainer.fit(module, block_data(96))
    got = {name: p.full_tensor().detach().clone() for name, p in module.model.named_parameters()}
    assert relative_error(got, want) < FP32_ROUNDING


class TinyLlama(CausalLM):
    """A Hugging Face Llama built from its config in configure_model, or loaded from a save_pretrained directory:
    under offload_params with lightning_zero_offload.load_pretrained once sharded, otherwise from_pretrained."""

    def __init__(self, pretrained: str | None = None) -> None:
        super().__init__()
        self.pretrained = pretrained
        self.model = None

    def configure_model(self) -> None:
        from transformers import LlamaForCausalLM

        if self.model is not None:
            return
        torch.manual_seed(0)
        offloaded = getattr(self.trainer.strategy, "options", None) is not None
        if self.pretrained is not None and not offloaded:
            self.model = LlamaForCausalLM.from_pretrained(self.pretrained).train()
            return
        self.model = LlamaForCausalLM(tiny_llama_config())
        if not offloaded:
            # The eager constructor draws twice (each layer's reset_parameters, then transformers' init); a model
            # built on the meta device is initialized once, by transformers' initialize_weights, in setup.
            for item in (*self.model.modules(), *self.model.parameters()):
                item.__dict__.pop("_is_hf_initialized", None)  # else initialize_weights skips them
            torch.manual_seed(0)
            self.model.initialize_weights()

    def on_fit_start(self) -> None:
        if self.pretrained is not None and getattr(self.trainer.strategy, "options", None) is not None:
            load_pretrained(self.model, self.pretrained)  # into the shards, tensor by tensor


def fit_llama(strategy, pretrained=None) -> dict[str, torch.Tensor]:
    module = TinyLlama(pretrained)
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))
    trainer = L.Trainer(strategy=strategy, max_steps=2, **QUIET)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in module.model.named_parameters()
    }


@pytest.mark.slow  # transformers' import and two Llama fits per case
@pytest.mark.parametrize("from_directory", [False, True])
def test_a_hugging_face_llama_from_config_or_from_save_pretrained_trains_as_under_auto(from_directory, tmp_path):
    pretrained = None
    if from_directory:
        from transformers import LlamaForCausalLM

        torch.manual_seed(1)  # other weights than the config's own init
        LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path, max_shard_size="100KB")  # an index file
        pretrained = str(tmp_path)
    want = fit_llama("auto", pretrained)
    got = fit_llama("zero_offload_params", pretrained)
    assert relative_error(got, want) < FP32_ROUNDING


class WithAFrequency(BlockRegression):
    """A float buffer the forward reads (as RoPE's frequencies are), which bf16 would round: 1.001 -> 1.0."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("frequency", torch.tensor(1.001))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.model(x * self.frequency).float() - y) ** 2).mean()


def test_buffers_keep_their_dtype_with_bf16_master_weights():
    """cpu_state="bf16" makes the parameters bf16 (the shards are the master), not the buffers: they stay as
    built, as under AMP and in the ZeRO-2 mode, which it equals bitwise (rounded to bf16, the buffer moved the
    weights 1.8e-2 relative from it)."""
    runs = {}
    for name, options in {"params": {"offload_params": True}, "zero2": {"in_place_on_cpu": False}}.items():
        module = WithAFrequency()
        strategy = ZeroOffloadStrategy(cpu_state="bf16", **options)
        L.Trainer(strategy=strategy, max_steps=3, precision="bf16-mixed", **QUIET).fit(module, block_data(24))
        assert module.frequency.dtype == torch.float32 and module.frequency.item() == pytest.approx(1.001)
        runs[name] = fit_weights(module)
    assert all(torch.equal(runs["params"][k], runs["zero2"][k].to(runs["params"][k].dtype)) for k in runs["zero2"])


def test_a_model_built_in_bf16_gets_fp32_master_weights_as_in_the_zero2_mode():
    """A model loaded in bf16 to save host memory (from_pretrained(torch_dtype=torch.bfloat16)) under bf16-mixed
    with fp32 state: its trainable parameters become fp32 shards, one at a time (they were refused, naming
    fully_shard), and train as the ZeRO-2 mode trains them (fp32 masters of the bf16 weights), bitwise."""
    runs = {}
    for name, options in {"params": {"offload_params": True}, "zero2": {"in_place_on_cpu": False}}.items():
        module = BlockRegression()
        module.model.to(torch.bfloat16)
        L.Trainer(strategy=ZeroOffloadStrategy(**options), max_steps=3, precision="bf16-mixed", **QUIET).fit(
            module, block_data(24)
        )
        runs[name] = fit_weights(module)
    assert {w.dtype for w in runs["params"].values()} == {torch.float32}
    # the ZeRO-2 mode hands back the module as built, in bf16: its masters rounded
    assert all(torch.equal(runs["params"][k].bfloat16(), runs["zero2"][k]) for k in runs["zero2"])


class TinyT5(CausalLM):
    """An encoder-decoder: Hugging Face's generate runs its encoder directly, not the model's forward."""

    def __init__(self) -> None:
        from transformers import T5Config, T5ForConditionalGeneration

        super().__init__()
        torch.manual_seed(0)
        config = T5Config(
            vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
        )
        self.model = T5ForConditionalGeneration(config)
        self.generated: list[torch.Tensor] = []

    def validation_step(self, batch, batch_idx):
        self.generated.append(self.model.generate(input_ids=batch[0], max_new_tokens=3, do_sample=False))


@pytest.mark.slow  # transformers' import and two T5 fits
def test_a_t5_trains_and_generates_during_and_after_fit_as_under_auto():
    tokens = DataLoader(TensorDataset(torch.randint(0, 128, (8, 12), generator=torch.Generator().manual_seed(3))), 4)
    runs = {}
    for strategy in ("auto", "zero_offload_params"):
        module = TinyT5()
        trainer = L.Trainer(strategy=strategy, max_steps=2, limit_val_batches=1, **QUIET)
        # FSDP2 warns of a view a T5 block returns (offload-params.md: only an in-place change of it would be wrong)
        view = pytest.warns(UserWarning, match="returned a view tensor") if strategy != "auto" else nullcontext()
        with view:
            trainer.fit(module, tokens, tokens)
        with torch.no_grad():
            after = module.model.generate(input_ids=next(iter(tokens))[0], max_new_tokens=3, do_sample=False)
        runs[strategy] = [*module.generated, after]
    assert len(runs["auto"]) == 3  # the sanity check's, the end of the epoch's, after fit
    assert all(torch.equal(ours, want) for ours, want in zip(runs["zero_offload_params"], runs["auto"]))


class Evaluated(BlockRegression):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.model(x) - y) ** 2).mean())

    def predict_step(self, batch, batch_idx):
        return self.model(batch[0])


def test_validate_predict_after_fit_and_fit_again_on_the_sharded_model():
    module = Evaluated()
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(offload_params=True), max_steps=3, **QUIET)
    trainer.fit(module, block_data(96), block_data(16))
    validated = trainer.validate(module, block_data(16), verbose=False)[0]["val_loss"]
    plain = BlockRegression()
    plain.model.load_state_dict(fit_weights(module))
    x, y = block_data(16).dataset.tensors  # two batches of 8: the mean of their means is the mean over all 16
    with torch.no_grad():
        want = float(((plain.model(x) - y) ** 2).mean())
    assert validated == pytest.approx(want, rel=1e-5)
    assert len(trainer.predict(module, block_data(16))) == 2
    again = L.Trainer(strategy=ZeroOffloadStrategy(offload_params=True), max_steps=6, **QUIET)
    again.fit(module, block_data(96))
    assert again.global_step == 6


def test_evaluation_stages_gather_in_the_compute_dtype_and_calls_after_them_in_fp32():
    """After a fit the units gather in fp32 for direct calls; a validate/predict stage, under the precision's
    autocast, gathers in the compute dtype again (fp32 doubled a block in flight there), then hands fp32 back."""
    module = Evaluated()
    strategy = lambda: ZeroOffloadStrategy(offload_params=True)  # noqa: E731
    L.Trainer(strategy=strategy(), max_steps=2, precision="bf16-mixed", **QUIET).fit(module, block_data(32))
    gathered = []
    hook = module.model.blocks[0].register_forward_pre_hook(lambda m, _: gathered.append(m.fc1.weight.dtype))
    trainer = L.Trainer(strategy=strategy(), precision="bf16-mixed", **QUIET)
    trainer.validate(module, block_data(16), verbose=False)
    trainer.predict(module, block_data(16))
    assert set(gathered) == {torch.bfloat16}
    gathered.clear()
    with torch.no_grad():
        assert module.model(block_data(8).dataset.tensors[0]).dtype == torch.float32  # fp32 inputs, no autocast
    hook.remove()
    assert set(gathered) == {torch.float32}


class CallsTheModelsLayers(BlockRegression):
    """A step that runs ``self.model``'s layers itself and never calls ``self.model`` (as a step computing a loss
    from a Hugging Face model's ``.model`` and ``.lm_head`` does)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = self.model.embed(x)
        for block in self.model.blocks:
            x = block(x)
        return ((self.model.head(x).float() - y) ** 2).mean()


@pytest.mark.parametrize("cpu_step", ["sync", "speculative"])
def test_a_step_that_never_calls_the_holder_trains_as_one_that_does(cpu_step):
    """``self.model`` is a unit of its own (it holds every parameter): the root gathers it at each step, so a step
    that calls only its layers gets its parameters too, and the same gradients."""
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3}
    strategy = ZeroOffloadStrategy(offload_params=True, cpu_step=cpu_step)
    module = CallsTheModelsLayers()
    L.Trainer(strategy=strategy, max_steps=5, **QUIET, **arguments).fit(module, block_data(96))
    assert isinstance(module.model, FSDPModule)
    want = fit(ZeroOffloadStrategy(offload_params=True, cpu_step=cpu_step), **arguments)
    assert all(torch.equal(fit_weights(module)[name], want[name]) for name in want)


@pytest.mark.parametrize(
    "averaging",
    [
        lambda: StochasticWeightAveraging(swa_lrs=1e-3),
        lambda: WeightAveraging(avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.9)),
    ],
    ids=["swa", "ema"],
)
def test_lightnings_weight_averaging_is_refused_naming_the_zero2_mode(averaging):
    """Its unsharded copy of the whole model on the device is what the mode keeps off it (and it failed there with
    "aten.copy_.default got mixed torch.Tensor and DTensor")."""
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(offload_params=True), max_steps=1, callbacks=[averaging()], **QUIET
    )
    with pytest.raises(ValueError, match="unsharded copy of the whole model.*offload_params=False"):
        trainer.fit(BlockRegression(), block_data(8))


class BackboneAndHead(BlockRegression):
    """A backbone holding the blocks and a head beside it, as fine-tuning modules are built."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.head(self.model(x)).float() - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_a_backbone_beside_a_head_is_a_unit_of_its_own_and_runs_when_called_directly():
    """The backbone holds the blocks: it is wrapped around them (the head stays with the root), so after fit
    ``lit.model(x)`` gathers its parameters as under auto; before, it failed with "got mixed torch.Tensor and
    DTensor" unless ``lit.unshard()`` came first."""
    x = block_data(8).dataset.tensors[0]
    runs = {}
    for name, strategy in {"auto": "auto", "ours": ZeroOffloadStrategy(offload_params=True)}.items():
        module = BackboneAndHead()
        trainer = L.Trainer(strategy=strategy, max_steps=4, gradient_clip_val=0.3, accumulate_grad_batches=2, **QUIET)
        trainer.fit(module, block_data(64))
        weights = {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in module.named_parameters()}
        with torch.no_grad():
            runs[name] = (weights, module.model(x))
    assert isinstance(module.model, FSDPModule) and not isinstance(module.head, FSDPModule)
    assert relative_error(runs["ours"][0], runs["auto"][0]) < FP32_ROUNDING
    torch.testing.assert_close(runs["ours"][1], runs["auto"][1], rtol=0, atol=1e-6)


class LastMicroBatchReturnsNone(BlockRegression):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:`training_step` returned `None`")  # Lightning's, under auto too
@pytest.mark.parametrize("cpu_step", ["sync", "speculative"])
def test_a_window_whose_last_training_step_returns_none_steps_as_under_auto(cpu_step):
    """That step's forward gathers what the root gathers (the holder, the root's own parameters) and no backward
    reshards it: the step wrote the shards under the gathered copy and the next forward used the old weights
    (1.8e-2 off auto in a helper's run). The step reshards every unit first."""
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3}
    want, got = LastMicroBatchReturnsNone(), LastMicroBatchReturnsNone()
    L.Trainer(strategy="auto", max_steps=4, **QUIET, **arguments).fit(want, block_data(64))
    strategy = ZeroOffloadStrategy(offload_params=True, cpu_step=cpu_step)
    L.Trainer(strategy=strategy, max_steps=4, **QUIET, **arguments).fit(got, block_data(64))
    assert relative_error(fit_weights(got), fit_weights(want)) < FP32_ROUNDING


class FailsInItsHead(L.LightningModule):
    """A user's bug in forward at the second step: the wrong width into the head (the root's own parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h[:, :3] if self.trainer.global_step == 1 else h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self(x) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def test_an_error_in_forward_reaches_the_user_and_not_the_teardowns():
    """The forward that raised leaves FSDP2's root gathered, and Lightning's teardown (module.cpu()) then failed with
    "'Parameter' object has no attribute '_local_tensor'", which replaced the user's error."""
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(offload_params=True), max_steps=3, **QUIET)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        trainer.fit(FailsInItsHead(), block_data(32))


class FinetunedWithValidation(BackboneAndHead):
    @property
    def backbone(self) -> torch.nn.Module:  # what BackboneFinetuning freezes, then unfreezes
        return self.model

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.head(self.model(x)) - y) ** 2).mean())


def test_backbone_finetuning_after_validation_trains_as_under_auto():
    """A forward without backward (validation) left the root's parameters (the head's) gathered, so the module's
    parameters were not those the optimizer holds, and BackboneFinetuning's mapping of one to the other failed
    with a KeyError of a DTensor. Evaluation steps now reshard every unit."""
    runs = {}
    for name, strategy in {"auto": "auto", "ours": ZeroOffloadStrategy(offload_params=True)}.items():
        module = FinetunedWithValidation()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        trainer = L.Trainer(strategy=strategy, max_epochs=2, callbacks=[finetuning], limit_val_batches=1, **QUIET)
        trainer.fit(module, block_data(32), block_data(8))
        runs[name] = {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in module.named_parameters()}
    assert relative_error(runs["ours"], runs["auto"]) < FP32_ROUNDING


def test_a_backbone_built_in_bf16_that_a_callback_will_unfreeze_is_refused_at_setup():
    """A frozen parameter keeps the dtype it was built in when sharded, and with fp32 state an unfrozen bf16 shard
    cannot be a master: the unfreeze failed an epoch into the run (found by a review)."""
    module = FinetunedWithValidation()
    module.to(torch.bfloat16)
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(offload_params=True),
        precision="bf16-mixed",
        callbacks=[finetuning],
        max_epochs=2,
        **QUIET,
    )
    with pytest.raises(ValueError, match=r"'model\.embed\.weight' is torch.bfloat16: .*\(model\.float\(\)\)"):
        trainer.fit(module, block_data(32), block_data(8))


class SamplesAtEpochEnd(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        with torch.no_grad():
            pl_module(block_data(8).dataset.tensors[0])


class FinetunedWithForward(FinetunedWithValidation):
    def forward(self, x):
        return self.head(self.model(x))


def test_backbone_finetuning_after_a_callbacks_forward_trains_as_under_auto():
    """A callback's forward under no_grad between epochs left the root's and the backbone's gathered copies in
    place of the shards (BaseFinetuning then failed: "aten.equal.default got mixed torch.Tensor and DTensor")."""
    runs = {}
    for name, strategy in {"auto": "auto", "ours": ZeroOffloadStrategy(offload_params=True)}.items():
        module = FinetunedWithForward()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        trainer = L.Trainer(strategy=strategy, max_epochs=2, callbacks=[finetuning, SamplesAtEpochEnd()], **QUIET)
        trainer.fit(module, block_data(32))
        runs[name] = {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in module.named_parameters()}
    assert relative_error(runs["ours"], runs["auto"]) < FP32_ROUNDING


def test_backbone_finetuning_under_bf16_mixed_trains_as_the_zero2_mode():
    """bf16-mixed: the frozen backbone in fp32 as it is (FSDP2 gathered it in bf16), and unfrozen at epoch 1 in bf16
    with its gradients (FSDP2 had fixed the backbone's gradient dtype at the first forward, while it was frozen:
    "attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float"). Bitwise the ZeRO-2
    mode's result, which keeps frozen parameters as AMP does."""
    runs = {}
    for params in (False, True):
        module = FinetunedWithValidation()
        finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5)
        strategy = ZeroOffloadStrategy(offload_params=params, in_place_on_cpu=False)
        trainer = L.Trainer(
            strategy=strategy,
            precision="bf16-mixed",
            max_epochs=2,
            callbacks=[finetuning],
            **QUIET,
            limit_val_batches=0,
        )
        trainer.fit(module, block_data(32))
        runs[params] = {n: getattr(p, "full_tensor", p.detach)().detach().float() for n, p in module.named_parameters()}
    assert not [name for name, t in runs[True].items() if not torch.equal(t, runs[False][name])]


def fit_weights(module) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "full_tensor", p.detach)().detach().clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize(
    ("precision", "cpu_state"), [("32-true", "fp32"), ("bf16-mixed", "fp32"), ("bf16-mixed", "bf16")]
)
def test_after_fit_the_inner_model_runs_when_called_directly(precision, cpu_state):
    """The LightningModule holds its parameters in one child (``self.model``): that child is an FSDP2 unit of its
    own (the LightningModule, the root, owns nothing), so a direct call after fit gathers them as under auto. Under
    a mixed precision they are gathered in fp32, as the module computes under auto after fit: in the compute dtype,
    a call with fp32 inputs (there is no autocast outside fit) failed with "mat1 and mat2 must have the same
    dtype"; another fit gathers them in the compute dtype again (bitwise the ZeRO-2 mode fitting twice)."""
    strategy = lambda: ZeroOffloadStrategy(offload_params=True, cpu_state=cpu_state)  # noqa: E731
    module = BlockRegression()
    L.Trainer(strategy=strategy(), max_steps=2, precision=precision, **QUIET).fit(module, block_data(32))
    assert isinstance(module.model, FSDPModule) and not list(module.parameters(recurse=False))
    plain = BlockRegression()
    plain.model.load_state_dict({k: v.float() for k, v in fit_weights(module).items()})
    x = block_data(8).dataset.tensors[0]
    with torch.no_grad():
        torch.testing.assert_close(module.model(x), plain.model(x), rtol=0, atol=1e-6)
    gathered = []  # the dtype a block's weight is gathered in for the second fit's forwards
    hook = module.model.blocks[0].register_forward_pre_hook(lambda m, _: gathered.append(m.fc1.weight.dtype))
    zero2 = BlockRegression()
    for trained, each in ((module, strategy), *[(zero2, lambda: ZeroOffloadStrategy(cpu_state=cpu_state))] * 2):
        L.Trainer(strategy=each(), max_steps=2, precision=precision, **QUIET).fit(trained, block_data(32))
    hook.remove()
    assert set(gathered) == {torch.float32 if precision == "32-true" else torch.bfloat16}
    assert all(torch.equal(v.float(), zero2.model.state_dict()[k].float()) for k, v in fit_weights(module).items())

"""The ZeRO-2 mode with a model built on the meta device (``configure_model``, ``trainer.init_module(
empty_init=True)``): filled block by block into the engine, it trains bitwise as the model built eagerly with the
same seed; pretrained weights reach the master weights through the engine, in their own precision."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET, BlockRegression, BlockRegressionInConfigureModel, CausalLM, block_data
from offload_params_helpers import Blocks, two_groups
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy, load_pretrained


def fit(module: L.LightningModule, precision: str, **options) -> dict[str, torch.Tensor]:
    strategy = ZeroOffloadStrategy(**options)
    trainer = L.Trainer(strategy=strategy, precision=precision, max_steps=4, gradient_clip_val=0.5, **QUIET)
    trainer.fit(module, block_data(64))
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    assert not [name for name in got if not torch.equal(got[name], want[name])]


@pytest.mark.parametrize(
    ("precision", "options"),
    [("32-true", {}), ("bf16-mixed", {"in_place_on_cpu": False}), ("bf16-mixed", {"cpu_state": "bf16"})],
)
def test_a_model_built_in_configure_model_trains_bitwise_as_the_eager_one(precision, options):
    assert_bitwise(
        fit(BlockRegressionInConfigureModel(), precision, **options), fit(BlockRegression(), precision, **options)
    )


def test_init_module_empty_init_builds_on_the_meta_device_and_trains_as_the_eager_one():
    strategy = ZeroOffloadStrategy(in_place_on_cpu=False)
    trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=4, gradient_clip_val=0.5, **QUIET)
    # Lightning's warning, for any strategy with a model_sharded_context of its own
    with pytest.warns(UserWarning, match="cannot fully support"), trainer.init_module(empty_init=True):
        module = BlockRegression()
    assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, block_data(64))
    got = {name: t.detach().clone() for name, t in module.state_dict().items()}
    assert_bitwise(got, fit(BlockRegression(), "bf16-mixed", in_place_on_cpu=False))


def test_validate_alone_materializes_the_model_whole():
    module = BlockRegressionInConfigureModel()
    module.validation_step = lambda batch, batch_idx: module.log("loss", module.training_step(batch, batch_idx))
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(), **QUIET)
    assert trainer.validate(module, block_data(16), verbose=False)[0]["loss"] > 0
    assert not any(p.is_meta for p in module.parameters())


class Pretrained(BlockRegressionInConfigureModel):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_fit_start(self) -> None:
        load_pretrained(self.model, self.path)


def test_load_pretrained_writes_the_engines_master_weights_in_the_checkpoints_precision(tmp_path):
    """Written into the parameters (the bf16 device copy), the weights would reach the master rounded; through
    the engine they are the file's fp32 values, as in a module that loaded them before setup."""
    torch.manual_seed(5)
    torch.save(Blocks().state_dict(), tmp_path / "weights.pt")
    eager = BlockRegression()
    eager.model.load_state_dict(torch.load(tmp_path / "weights.pt", weights_only=True))
    want = fit(eager, "bf16-mixed", in_place_on_cpu=False)
    assert_bitwise(fit(Pretrained(str(tmp_path / "weights.pt")), "bf16-mixed", in_place_on_cpu=False), want)


class Llama(CausalLM):
    """A Hugging Face Llama from a save_pretrained directory: loaded before fit (``eager``), or built from its
    config in configure_model and loaded with load_pretrained once the engine holds it."""

    def __init__(self, directory: str, eager: bool) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.directory, self.eager = directory, eager
        self.model = LlamaForCausalLM.from_pretrained(directory).train() if eager else None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is None:  # on the meta device
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.directory))

    def on_fit_start(self) -> None:
        if not self.eager:
            load_pretrained(self.model, self.directory)


@pytest.mark.slow  # transformers' import and two Llama fits
@pytest.mark.parametrize("tied", [False, True])
def test_a_hugging_face_llama_from_config_and_load_pretrained_trains_as_from_pretrained(tied, tmp_path):
    from offload_params_helpers import tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    LlamaForCausalLM(tiny_llama_config(tied)).save_pretrained(tmp_path, max_shard_size="100KB")  # an index file
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))
    runs = {}
    for eager in (True, False):
        module = Llama(str(tmp_path), eager)
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(in_place_on_cpu=False), precision="bf16-mixed", max_steps=2, **QUIET
        )
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
        runs[eager] = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
        assert (module.model.lm_head.weight is module.model.model.embed_tokens.weight) == tied
    assert_bitwise(runs[False], runs[True])


class LitGPT(L.LightningModule):
    def __init__(self, eager: bool) -> None:
        super().__init__()
        from litgpt import GPT, Config

        self.config = Config.from_name("pythia-14m")
        self.gpt = None
        if eager:
            torch.manual_seed(0)
            self.gpt = GPT(self.config)

    def configure_model(self) -> None:
        from litgpt import GPT

        if self.gpt is None:  # on the meta device; GPT.reset_parameters recomputes its rope cache
            torch.manual_seed(0)
            self.gpt = GPT(self.config)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.gpt(tokens[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.slow  # litgpt's import and two fits
def test_litgpt_built_in_configure_model_trains_bitwise_as_built_eagerly():
    pytest.importorskip("litgpt")
    tokens = torch.randint(0, 50_000, (8, 17), generator=torch.Generator().manual_seed(0))
    runs = {}
    for eager in (True, False):
        module = LitGPT(eager)
        strategy = ZeroOffloadStrategy(in_place_on_cpu=False)
        trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=2, **QUIET)
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
        runs[eager] = {k: v.detach().clone() for k, v in module.gpt.state_dict().items()}
    assert_bitwise(runs[False], runs[True])


# -- what users do around a model on the meta device (each was lost or refused once) -------------------------


class Rotary(nn.Module):
    """A non-persistent buffer that load_state_dict(assign=True) leaves on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.empty(4), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.rotary = Rotary()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) * self.rotary.inv_freq.repeat(2))


class AssignLoaded(L.LightningModule):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.weights, self.model = weights, None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = WithRotary()  # on the meta device
            self.model.load_state_dict(self.weights, assign=True)  # real weights, the buffer still on meta

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.model(x) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        self.log("loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.0)  # the weights must stay the loaded ones


def test_weights_loaded_with_assign_are_kept_and_the_buffer_left_on_meta_computed():
    torch.manual_seed(0)
    weights = WithRotary().state_dict()
    loader = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=8)
    fitted = AssignLoaded(weights)
    L.Trainer(strategy=ZeroOffloadStrategy(), max_steps=1, **QUIET).fit(fitted, loader)
    validated = AssignLoaded(weights)
    L.Trainer(strategy=ZeroOffloadStrategy(), **QUIET).validate(validated, loader, verbose=False)
    for module in (fitted, validated):
        assert all(torch.equal(module.model.state_dict()[k], v) for k, v in weights.items())
        assert torch.equal(module.model.rotary.inv_freq, Rotary().inv_freq)


def test_load_from_checkpoint_inside_init_module_empty_init_keeps_the_checkpoints_weights(tmp_path):
    torch.manual_seed(3)
    source = BlockRegression()
    torch.save({"state_dict": source.state_dict(), "pytorch-lightning_version": L.__version__}, tmp_path / "w.ckpt")
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(), max_steps=1, **QUIET)
    with pytest.warns(UserWarning, match="cannot fully support"), trainer.init_module(empty_init=True):
        module = BlockRegression.load_from_checkpoint(
            tmp_path / "w.ckpt"
        )  # a load inside: the model materialized first
    assert_bitwise(module.state_dict(), source.state_dict())


class PartlyInInit(BlockRegression):
    """An output scale built in __init__, the blocks in configure_model (on the meta device)."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.scale = nn.Linear(1, 1)
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(1)
            self.model = Blocks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.scale(self.model(x).float()) - y) ** 2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW([*two_groups(self.model), {"params": self.scale.parameters()}])


class PartlyEager(PartlyInInit):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.model = Blocks()


def test_a_model_built_partly_in_init_and_partly_in_configure_model_trains_as_the_eager_one():
    options = {"in_place_on_cpu": False}
    assert_bitwise(fit(PartlyInInit(), "bf16-mixed", **options), fit(PartlyEager(), "bf16-mixed", **options))


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))  # no reset_parameters: nothing can initialize it on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Uninitializable(BlockRegressionInConfigureModel):
    def configure_model(self) -> None:
        if self.model is None:
            self.model = nn.Sequential(Gain(), nn.Linear(8, 1))


def test_what_nothing_can_initialize_is_the_error_the_user_sees():
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(), max_steps=1, **QUIET)
    with pytest.raises(ValueError, match="cannot initialize the parameters or buffers of Gain"):
        trainer.fit(Uninitializable(), block_data(64))  # not teardown's "Cannot copy out of meta tensor"


def test_validate_alone_takes_a_model_built_partly_on_the_meta_device():
    module = PartlyInInit()
    module.validation_step = lambda batch, batch_idx: module.log("loss", module.training_step(batch, batch_idx))
    scale = module.scale.weight.detach().clone()
    trainer = L.Trainer(strategy=ZeroOffloadStrategy(), **QUIET)
    assert trainer.validate(module, block_data(16), verbose=False)[0]["loss"] > 0
    assert torch.equal(module.scale.weight, scale)  # built in __init__: kept as it was
    assert not any(p.is_meta for p in module.parameters())


class TwoOptimizers(BlockRegressionInConfigureModel):
    def configure_optimizers(self):
        return [torch.optim.AdamW(self.model.embed.parameters()), torch.optim.AdamW(self.model.head.parameters())]


def test_a_setup_that_fails_after_the_placeholders_leaves_the_model_on_the_meta_device():
    module = TwoOptimizers()
    with pytest.raises(RuntimeError, match="multiple optimizers"):
        L.Trainer(strategy=ZeroOffloadStrategy(), max_steps=1, **QUIET).fit(module, block_data(64))
    assert all(p.is_meta for p in module.parameters())  # not the placeholders' zeros


class LoraInConfigureModel(CausalLM):
    """PEFT's LoRA on a Hugging Face Llama, both built in configure_model (on the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.start: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        from offload_params_helpers import tiny_llama_config
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaForCausalLM

        if self.model is None:
            lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
            self.model = get_peft_model(LlamaForCausalLM(tiny_llama_config()), lora)

    def on_train_start(self) -> None:
        self.start = {n: getattr(p, "full_tensor", p.detach)().clone() for n, p in self.named_parameters()}


@pytest.mark.slow  # transformers' and PEFT's imports
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT asks transformers
@pytest.mark.parametrize("offload_params", [False, True], ids=["zero2", "offload-params"])
def test_lora_adapters_built_in_configure_model_start_as_peft_initializes_them(offload_params):
    """B zero (the adapted model starts as the base model), A within nn.Linear's kaiming bound; the model's own
    init gave both the values of an ordinary layer."""
    pytest.importorskip("peft")
    module = LoraInConfigureModel()
    strategy = ZeroOffloadStrategy(in_place_on_cpu=False, offload_params=offload_params)
    tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))
    L.Trainer(strategy=strategy, max_steps=1, **QUIET).fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
    b = [t for n, t in module.start.items() if "lora_B" in n]
    a = torch.cat([t.flatten() for n, t in module.start.items() if "lora_A" in n])
    assert len(b) == 6 and all(not t.any() for t in b)
    assert 0 < a.abs().max() <= 1 / 64**0.5  # kaiming_uniform_(a=sqrt(5)) over the width of 64

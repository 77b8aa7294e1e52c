"""``ZeroOffloadStrategy(offload_params=True, device_share=...)`` in the Trainer: the same training as without a
share, checkpoints that resume with another share, and the summary that says what the share holds."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET, BlockRegression, BlockRegressionInConfigureModel, CausalLM, block_data
from offload_params_helpers import relative_error, tiny_llama_config
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.core import release_process_group
from lightning_zero_offload.trainer.callbacks import format_summary

FP32_ROUNDING = 1e-6  # normwise; observed 0 (the device step, torch's fused AdamW, agrees with the kernel here)
STATE = {"fp32": "32-true", "bf16": "bf16-mixed"}


@pytest.fixture(autouse=True)
def own_process_group():
    yield
    release_process_group()


def weights(module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().float().clone() for name, p in module.model.named_parameters()}


def fit(share, cpu_state="fp32", module=None, max_steps=5, ckpt_path=None, save=None, tmp_path=None, **options):
    module = module or BlockRegression()
    strategy = ZeroOffloadStrategy(offload_params=True, device_share=share, cpu_state=cpu_state, **options)
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3, "precision": STATE[cpu_state]}
    trainer = L.Trainer(strategy=strategy, max_steps=max_steps, default_root_dir=tmp_path, **{**QUIET, **arguments})
    trainer.fit(module, block_data(48), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return weights(module), trainer


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], cpu_state: str) -> bool:
    """bf16 state bitwise; fp32 within rounding."""
    if cpu_state == "bf16":
        return all(torch.equal(got[k], v) for k, v in want.items())
    return relative_error(got, want) < FP32_ROUNDING


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
def test_a_share_trains_as_none_with_accumulation_clipping_and_a_scheduler(cpu_state):
    want, _ = fit(0.0, cpu_state)
    got, trainer = fit(0.5, cpu_state, cpu_step="speculative")
    assert same(got, want, cpu_state)
    engine = trainer.strategy.session.engine
    assert 0 < engine.memory_report()["device_share_params"] <= 0.5 * engine.memory_report()["params"]
    summary = format_summary(trainer.strategy.session, {}, 0)
    assert "device share:" in summary and "keep shards, gradients and state on the device" in summary


def test_a_model_built_in_configure_model_takes_the_share_too():
    want, _ = fit(0.0)
    got, trainer = fit(0.5, module=BlockRegressionInConfigureModel())
    assert same(got, want, "fp32")
    assert any(slot.on_device for slot in trainer.strategy.session.engine.slots)


@pytest.mark.parametrize(
    ("cpu_state", "checkpoint_format"),
    [("fp32", "full"), ("bf16", "sharded")],
)
def test_a_checkpoint_resumes_with_another_share(cpu_state, checkpoint_format, tmp_path):
    """Saved with no share, resumed with one, and the other way round: both equal the run resumed as it was."""
    runs = {}
    for saved, resumed in ((0.0, 0.0), (0.0, 1.0), (0.5, 0.0)):
        path = tmp_path / f"{saved}-{resumed}"
        common = {"cpu_state": cpu_state, "checkpoint_format": checkpoint_format, "tmp_path": tmp_path}
        fit(saved, max_steps=3, save=path, **common)
        runs[saved, resumed], _ = fit(resumed, max_steps=6, ckpt_path=path, **common)
    want = runs[0.0, 0.0]
    assert same(runs[0.0, 1.0], want, cpu_state)
    assert same(runs[0.5, 0.0], want, cpu_state)


@pytest.mark.parametrize("share", [0.5, "auto"])
def test_a_second_fit_keeps_the_units_where_the_first_put_them(share):
    module = BlockRegression()
    first, trainer = fit(share, module=module, max_steps=2)
    held = trainer.strategy.session.engine.memory_report()["device_share_params"]
    again, trainer = fit(share, module=module, max_steps=2)
    assert trainer.strategy.session.engine.memory_report()["device_share_params"] == held
    assert any(not torch.equal(again[k], v) for k, v in first.items())  # it trained on


class Llama(CausalLM):
    """A Hugging Face Llama built from its config in configure_model (on the meta device under the strategy)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied, self.model = tied, None

    def configure_model(self) -> None:
        from transformers import LlamaForCausalLM

        if self.model is None:
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(tiny_llama_config(tied=self.tied))


@pytest.mark.slow  # transformers' import and four Llama fits
@pytest.mark.parametrize("tied", [False, True])
def test_a_hugging_face_llama_with_a_share_trains_as_without(tied):
    """The root (the embedding, the head: tied or not, the final norm) and the first decoder layers on the device,
    bf16 state: bitwise the run without a share, with a clip that fires."""
    runs = {}
    for share in (0.0, 0.6):
        module = Llama(tied)
        strategy = ZeroOffloadStrategy(offload_params=True, device_share=share, cpu_state="bf16")
        tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(3))
        trainer = L.Trainer(strategy=strategy, max_steps=3, precision="bf16-mixed", gradient_clip_val=0.5, **QUIET)
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=4))
        engine = trainer.strategy.session.engine
        names = {id(p): n for n, p in module.model.named_parameters()}
        runs[share] = weights(module), {names[id(s.param)] for s in engine.slots if s.on_device}
        assert engine.last.grad_norm > 0.5
    (without, none), (got, on_device) = runs[0.0], runs[0.6]
    assert not none and "model.embed_tokens.weight" in on_device and "model.layers.0.mlp.up_proj.weight" in on_device
    assert "model.layers.1.mlp.up_proj.weight" not in on_device
    assert all(torch.equal(got[k], v) for k, v in without.items())


def zero2_fit(share, cpu_state, tmp_path, max_steps=6, ckpt_path=None, save=None, checkpoint_format="full"):
    """The ZeRO-2 mode (no ``offload_params``) on the offload data path, small buckets: several on each side."""
    from helpers import Classifier, loader

    module = Classifier(width=64)
    strategy = ZeroOffloadStrategy(
        device_share=share,
        cpu_state=cpu_state,
        cpu_step="speculative",
        in_place_on_cpu=False,
        bucket_size_mb=0.004,
        checkpoint_format=checkpoint_format,
    )
    arguments = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3, "precision": STATE[cpu_state]}
    trainer = L.Trainer(strategy=strategy, max_steps=max_steps, default_root_dir=tmp_path, **{**QUIET, **arguments})
    trainer.fit(module, loader(48), loader(16), ckpt_path=ckpt_path)  # 3 steps an epoch: resumes at its end
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}, trainer


def test_a_share_smaller_than_the_last_bucket_says_it_holds_nothing(tmp_path):
    _, trainer = zero2_fit(0.01, "fp32", tmp_path, max_steps=1)
    session = trainer.strategy.session
    assert session.engine.memory_report()["device_share_params"] == 0
    summary = format_summary(session, {}, 0)
    assert "device share: none: device_share=0.01 holds less than the last bucket (bucket_size_mb)" in summary


@pytest.mark.parametrize(("cpu_state", "checkpoint_format"), [("fp32", "full"), ("bf16", "sharded")])
def test_zero2_buckets_take_a_share_and_checkpoints_move_between_shares(cpu_state, checkpoint_format, tmp_path):
    want, _ = zero2_fit(0.0, cpu_state, tmp_path)
    got, trainer = zero2_fit(0.5, cpu_state, tmp_path)
    assert same(got, want, cpu_state)
    session = trainer.strategy.session
    assert 0 < session.engine.memory_report()["device_share_params"] <= 0.5 * session.engine.memory_report()["params"]
    assert "device share:" in format_summary(session, {}, 0)
    resumed = {}
    for saved, loaded in ((0.0, 0.0), (0.5, 0.0), (0.0, 1.0)):
        path = tmp_path / f"{saved}-{loaded}.ckpt"
        zero2_fit(saved, cpu_state, tmp_path, max_steps=3, save=path, checkpoint_format=checkpoint_format)
        resumed[saved, loaded], _ = zero2_fit(
            loaded, cpu_state, tmp_path, ckpt_path=path, checkpoint_format=checkpoint_format
        )
    assert same(resumed[0.5, 0.0], resumed[0.0, 0.0], cpu_state) and same(
        resumed[0.0, 1.0], resumed[0.0, 0.0], cpu_state
    )


def test_zero2_auto_says_what_it_chose_after_the_second_step(tmp_path):
    _, trainer = zero2_fit("auto", "fp32", tmp_path, max_steps=3)
    assert trainer.strategy.session.engine.share_choice.share == 0.0
    assert "device_share=auto: none, a CPU device is host memory" in format_summary(trainer.strategy.session, {}, 0)


def test_zero2_auto_starts_with_the_share_the_pre_flight_gives_and_says_so(monkeypatch, tmp_path):
    """Where the host holds the rest only with a share, the pre-flight's start (planner/preflight.py, an accelerator's:
    pretended here) reaches the engine: the run starts with it, keeps it after "auto" chooses and trains as without a
    share; the summary says why at each stage."""
    from lightning_zero_offload.core import session
    from lightning_zero_offload.engine.step.device_share import ShareChoice

    start = ShareChoice(0.5, 0, "auto: as the pre-flight would start it")
    checked = session.check_host_memory

    def pre_flight(module, options, *args, **kwargs):
        return checked(module, options, *args, **kwargs) or (start if options.device_share == "auto" else None)

    monkeypatch.setattr(session, "check_host_memory", pre_flight)
    want, _ = zero2_fit(0.0, "fp32", tmp_path)
    _, trainer = zero2_fit("auto", "fp32", tmp_path, max_steps=2)
    assert "device_share=auto: as the pre-flight would start it" in format_summary(trainer.strategy.session, {}, 0)
    assert trainer.strategy.session.engine.memory_report()["device_share_params"] > 0
    got, trainer = zero2_fit("auto", "fp32", tmp_path)
    summary = format_summary(trainer.strategy.session, {}, 0)
    assert "device share:" in summary and "on the device since setup, without which the host" in summary
    assert same(got, want, "fp32")

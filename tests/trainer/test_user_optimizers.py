"""User optimizers and parameters that the offload path used to train differently from strategy="auto"
without a word, through the Trainer and Fabric, against plain Lightning.

Each case either behaves as under "auto" (step hooks, a subclass that leaves Adam's update alone) or is
refused with an error naming what and the fix: a subclass overriding step(), a complex, float64 (under
bf16-mixed) or expand()-ed parameter, amsgrad switched on mid-run. Every refusal is checked on the
offload path (32-true with in_place_on_cpu=False, and bf16-mixed) and, for 32-true, in place.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import QUIET
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from user_code_helpers import AdamWWithDefaults, HookedTiny, Tiny, data

import lightning_zero_offload  # noqa: F401  (registers "zero_offload")
from lightning_zero_offload import ZeroOffloadFabricStrategy, ZeroOffloadStrategy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIGS = [
    pytest.param("32-true", {"in_place_on_cpu": False}, id="32-offload"),
    pytest.param("32-true", {}, id="32-in-place"),
    pytest.param("bf16-mixed", {}, id="bf16-mixed"),
]
FP32 = CONFIGS[:2]


class GradientCentralizedAdamW(torch.optim.AdamW):
    """Gradient centralisation (Yong et al. 2020), a common AdamW variant: its own step() edits the gradients."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.dim() > 1:
                    p.grad.sub_(p.grad.mean(dim=1, keepdim=True))
        super().step()
        return loss


def fit(model: L.LightningModule, precision: str, options: dict | None = None, **kwargs) -> L.Trainer:
    """strategy="auto" when ``options`` is None, else zero_offload with those options."""
    strategy = "auto" if options is None else ZeroOffloadStrategy(**options)
    trainer = L.Trainer(strategy=strategy, precision=precision, **{**QUIET, "max_steps": 5, **kwargs})
    trainer.fit(model, data())
    return trainer


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


# -- optimizer subclasses ----------------------------------------------------------------------


def test_the_step_override_changes_training_under_auto():
    """Why silently running it as plain AdamW was wrong: under auto the override moves the weights."""
    plain, centralized = Tiny(), Tiny(GradientCentralizedAdamW)
    fit(plain, "32-true")
    fit(centralized, "32-true")
    assert max_abs_diff(plain, centralized) > 1e-3


@pytest.mark.parametrize("precision,options", CONFIGS)
def test_an_adamw_subclass_that_overrides_step_is_refused_at_setup(precision, options):
    with pytest.raises(TypeError, match=r"GradientCentralizedAdamW: it overrides step\(\)") as info:
        fit(Tiny(GradientCentralizedAdamW), precision, options)
    assert "step() would never run" in str(info.value) and "strategy='auto'" in str(info.value)


@pytest.mark.parametrize("precision,options", FP32)
def test_a_subclass_that_only_overrides_init_trains_as_under_auto(precision, options):
    ref, ours = Tiny(AdamWWithDefaults), Tiny(AdamWWithDefaults)
    fit(ref, precision)
    fit(ours, precision, options)
    assert max_abs_diff(ref, ours) < 1e-6  # fp32 rounding of the fused kernel (tests/trainer/test_strategy.py's bound)


# -- step hooks ----------------------------------------------------------------------------------


@pytest.fixture
def global_hook_calls():
    calls: list[str] = []
    handles = [
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append("global post")),
    ]
    yield calls
    for handle in handles:
        handle.remove()


@pytest.mark.parametrize("precision,options", CONFIGS)
def test_step_hooks_fire_once_per_optimizer_step_as_under_auto(precision, options, global_hook_calls):
    """5 optimizer steps of 2 micro-batches: auto fires each hook 5 times; zero_offload used to fire none.
    The pre-hook's LR change applies to its own step under both (32-true: the weights match)."""
    ref, ours = HookedTiny(), HookedTiny()
    fit(ref, precision, accumulate_grad_batches=2, limit_train_batches=10, max_steps=5)
    by_auto, global_hook_calls[:] = list(global_hook_calls), []
    trainer = fit(ours, precision, options, accumulate_grad_batches=2, limit_train_batches=10, max_steps=5)
    assert trainer.global_step == 5
    assert ref.calls == ours.calls == ["pre", "post"] * 5
    assert by_auto == global_hook_calls == ["global pre", "global post"] * 5
    assert all(opt is ours.optimizer_made for opt in ours.hook_optimizers)  # the user's optimizer, as torch
    if precision == "32-true":
        assert max_abs_diff(ref, ours) < 1e-6


def test_fabric_fires_the_step_hooks_as_plain_fabric(global_hook_calls):
    def train(strategy) -> tuple[list[str], list[torch.optim.Optimizer], torch.optim.Optimizer]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        fabric.launch()
        model = Tiny()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        calls, seen = [], []
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: (calls.append("pre"), seen.append(opt))[-1])
        optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
        model, wrapped = fabric.setup(model, optimizer)
        for x, y in data(24):
            fabric.backward(nn.functional.mse_loss(model.net(x)[:, 0].float(), y))
            wrapped.step()
            wrapped.zero_grad()
        return calls, seen, optimizer

    ref_calls, _, _ = train("auto")
    by_fabric, global_hook_calls[:] = list(global_hook_calls), []
    for options in ({}, {"in_place_on_cpu": False}):
        calls, seen, optimizer = train(ZeroOffloadFabricStrategy(**options))
        assert calls == ref_calls == ["pre", "post"] * 3
        assert all(opt is optimizer for opt in seen)
        assert global_hook_calls == by_fabric == ["global pre", "global post"] * 3
        global_hook_calls.clear()


def test_fabric_refuses_a_step_override_and_a_complex_parameter_at_setup():
    def setup(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="bf16-mixed")
        fabric.launch()
        fabric.setup(model, optimizer)

    model = Tiny()
    with pytest.raises(TypeError, match="GradientCentralizedAdamW: it overrides step"):
        setup(model, GradientCentralizedAdamW(model.parameters()))
    model = Tiny(extra="complex")
    with pytest.raises(ValueError, match="'z' is torch.complex64"):
        setup(model, torch.optim.AdamW(model.parameters()))


# -- parameters the flat buffer cannot hold --------------------------------------------------------


@pytest.mark.parametrize("precision,options", CONFIGS)
def test_a_complex_parameter_is_refused_and_the_real_view_it_recommends_trains_as_auto(precision, options):
    """auto keeps it complex (Adam updates its real view); the bf16 flat buffer used to drop the imaginary part."""
    with pytest.raises(ValueError, match=r"'z' is torch.complex64: .*imaginary part would be dropped.*view_as_real"):
        fit(Tiny(extra="complex"), precision, options)
    if precision == "32-true":
        ref, ours = Tiny(extra="complex"), Tiny(extra="real-view")
        fit(ref, precision)
        fit(ours, precision, options)
        torch.testing.assert_close(ours.z.detach(), torch.view_as_real(ref.z.detach()), rtol=0, atol=1e-6)
    else:
        fit(Tiny(extra="real-view"), precision, options)  # the fix also runs under bf16-mixed


def test_a_float64_submodule_under_bf16_mixed_is_refused_at_setup_while_auto_trains_it_in_float64():
    """Autocast leaves float64 alone, so auto trains the head in float64; zero_offload used to round it to
    bf16 and fail inside forward ("mat1 and mat2 must have the same dtype")."""
    ref = Tiny(extra="float64")
    fit(ref, "bf16-mixed")
    assert ref.head.weight.dtype == torch.float64
    with pytest.raises(ValueError, match=r"'head.weight' is torch.float64 \(and 1 more\).*submodule.float\(\)"):
        fit(Tiny(extra="float64"), "bf16-mixed", {})


@pytest.mark.parametrize("precision,options", CONFIGS)
def test_an_expanded_parameter_is_refused_at_setup_instead_of_untied(precision, options):
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        fit(Tiny(extra="expanded"), precision)  # auto refuses it too, at the first step
    with pytest.raises(ValueError, match=r"cannot train 'rows': it is an expand\(\)-ed view.*\.clone\(\)"):
        fit(Tiny(extra="expanded"), precision, options)


# -- hyperparameters switched on mid-run ------------------------------------------------------------


class SwitchOnAmsgrad(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            trainer.optimizers[0].param_groups[0]["amsgrad"] = True


@pytest.mark.parametrize(
    "precision,options",
    [*CONFIGS, pytest.param("bf16-mixed", {"cpu_step": "speculative"}, id="bf16-speculative")],
)
def test_amsgrad_switched_on_mid_training_is_refused_at_that_step(precision, options):
    """auto fails there too (torch's KeyError 'max_exp_avg_sq'); zero_offload used to ignore it."""
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        fit(Tiny(), precision, callbacks=[SwitchOnAmsgrad()])
    model = Tiny()
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(**options),
        precision=precision,
        callbacks=[SwitchOnAmsgrad()],
        max_steps=5,
        **QUIET,
    )
    with pytest.raises(ValueError, match=r"param_groups\[0\]: amsgrad=True is not supported: .*amsgrad=False"):
        trainer.fit(model, data())
    assert trainer.global_step == 2  # the two steps before it were taken

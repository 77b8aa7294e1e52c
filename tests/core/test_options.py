"""Options both front ends share: ``timeout`` (types and range), and the fp32 warning's wording."""

from __future__ import annotations

import warnings
from datetime import timedelta

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.fabric.strategy import ZeroOffloadFabricStrategy

FRONT_ENDS = [ZeroOffloadStrategy, ZeroOffloadFabricStrategy]


@pytest.mark.parametrize("strategy", FRONT_ENDS)
@pytest.mark.parametrize("timeout", [1e20, 0, -5.0, float("inf"), timedelta(days=999_999)])
def test_an_out_of_range_timeout_names_the_option_and_the_range(strategy, timeout):
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds in \(0, 1e\+09\]"):
        strategy(timeout=timeout)


@pytest.mark.parametrize("strategy", FRONT_ENDS)
def test_both_front_ends_take_the_same_types(strategy):
    assert strategy(timeout=90.5)._timeout == timedelta(seconds=90.5)
    assert strategy(timeout=600)._timeout == timedelta(minutes=10)
    assert strategy(timeout=timedelta(hours=2))._timeout == timedelta(hours=2)
    assert strategy(timeout=None)._timeout is None
    with pytest.raises(TypeError, match="timeout"):
        strategy(timeout="600")


class AdamModel(BoringModel):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fp32_warnings(**options) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(**options), precision="32-true", accelerator="cpu", devices=1, max_steps=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(AdamModel())
    return [str(w.message) for w in caught if "training in '32-true'" in str(w.message)]


def test_the_fp32_warning_is_true_when_32_true_was_passed():
    (message,) = fp32_warnings(in_place_on_cpu=False)  # the offload path: a device copy in fp32
    assert "the precision passed, or Lightning's default when none is given" in message
    assert "(Lightning's default when precision is not given)" not in message  # the old claim, false here
    assert "precision='bf16-mixed'" in message


def test_no_fp32_warning_where_nothing_is_offloaded():
    assert fp32_warnings() == []  # a CPU device in place: the parameters are the fp32 master, no copy to shrink


@pytest.mark.parametrize("strategy", FRONT_ENDS)
def test_the_deprecated_alias_is_gone(strategy):
    with pytest.raises(TypeError, match="delayed_param_update"):
        strategy(delayed_param_update=True)


def test_an_option_that_does_not_apply_warns_once_through_preflight_and_engine():
    """The pre-flight check and the engine both resolve the options; only the engine warns, once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = L.Trainer(
            strategy=ZeroOffloadStrategy(speculation_rollback="snapshot"), precision="bf16-mixed", accelerator="cpu",
            devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(AdamModel())
    notes = [str(w.message) for w in caught if "speculation_rollback" in str(w.message)]
    assert notes == [
        "speculation_rollback='snapshot' has no effect: it applies to cpu_step='speculative' only, and "
        "cpu_step='auto' runs 'sync' on a cpu device"
    ]

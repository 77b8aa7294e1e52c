"""Options are checked once, at construction, and every error names the option to change."""

import os
import warnings

import pytest
import torch

from lightning_zero_offload.engine import LossScalerConfig, OffloadOptions
from lightning_zero_offload.engine.options import resolve_auto


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"bucket_size_mb": float("inf")}, ValueError, "bucket_size_mb"),
        ({"bucket_size_mb": "25"}, TypeError, "bucket_size_mb"),
        ({"bucket_size_mb": 0}, ValueError, "bucket_size_mb"),
        ({"cpu_threads": 2.5}, TypeError, "cpu_threads"),
        ({"cpu_threads": 0}, ValueError, "cpu_threads"),
        ({"overlap": "yes"}, TypeError, "overlap"),
        ({"pin_memory": 1}, TypeError, "pin_memory"),
        ({"cpu_step": "fast"}, ValueError, "cpu_step"),
        ({"speculation_rollback": "redo"}, ValueError, "speculation_rollback"),
        ({"dpu_warmup_steps": -1}, ValueError, "dpu_warmup_steps"),
        ({"dpu_weight_prediction": True}, ValueError, "cpu_step='delayed'"),
        ({"checkpoint_format": "zip"}, ValueError, "checkpoint_format"),
        ({"delayed_param_update": True, "cpu_step": "sync"}, ValueError, "delayed_param_update"),
    ],
)
def test_bad_options_name_the_option(kwargs, error, name):
    with pytest.raises(error, match=name):
        OffloadOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [({"init_scale": float("nan")}, ValueError, "loss_scale_init"), ({"hysteresis": 1.5}, TypeError, "hysteresis")],
)
def test_bad_loss_scaler_options_name_the_option(kwargs, error, name):
    with pytest.raises(error, match=name):
        LossScalerConfig(**kwargs)


def test_delayed_param_update_is_a_deprecated_alias():
    with pytest.warns(FutureWarning, match="cpu_step='delayed'"):
        options = OffloadOptions(delayed_param_update=True)
    assert options.cpu_step == "delayed"


def test_auto_resolves_per_device_and_caps_threads():
    cpu = resolve_auto(OffloadOptions(), torch.device("cpu"))
    assert (cpu.cpu_step, cpu.overlap) == ("sync", False)
    assert cpu.cpu_threads == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    accelerator = resolve_auto(OffloadOptions(), torch.device("cuda", 0), local_world_size=2)
    assert (accelerator.cpu_step, accelerator.overlap) == ("speculative", True)
    assert accelerator.cpu_threads == max(1, len(os.sched_getaffinity(0)) // 2)
    with pytest.warns(UserWarning, match="cpu_threads=10000"):
        capped = resolve_auto(OffloadOptions(cpu_threads=10000), torch.device("cpu"))
    assert capped.cpu_threads == len(os.sched_getaffinity(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_auto(OffloadOptions(cpu_step="delayed", overlap=True), torch.device("cpu")).overlap

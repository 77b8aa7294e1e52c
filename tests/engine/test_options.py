"""Options are valid by construction (every error names the option to change), frozen, and resolved for a
device, dtype and world size by one function; an option that does not apply there warns once, naming itself."""

import dataclasses
import os
import re
import warnings

import pytest
import torch
from engine_helpers import CPU, make_net

from lightning_zero_offload.core import make_offload_options
from lightning_zero_offload.engine import LossScalerConfig, OffloadEngine, OffloadOptions
from lightning_zero_offload.engine.options import DelayedOptions, SpeculativeOptions, resolve

CUDA = torch.device("cuda", 0)
CORES = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("build", "error", "name"),
    [
        (lambda: OffloadOptions(bucket_size_mb=float("inf")), ValueError, "bucket_size_mb"),
        (lambda: OffloadOptions(bucket_size_mb="25"), TypeError, "bucket_size_mb"),
        (lambda: OffloadOptions(bucket_size_mb=0), ValueError, "bucket_size_mb"),
        (lambda: OffloadOptions(cpu_threads=2.5), TypeError, "cpu_threads"),
        (lambda: OffloadOptions(cpu_threads=0), ValueError, "cpu_threads"),
        (lambda: OffloadOptions(overlap="yes"), TypeError, "overlap"),
        (lambda: OffloadOptions(pin_memory=1), TypeError, "pin_memory"),
        (lambda: OffloadOptions(cpu_step="fast"), ValueError, "cpu_step"),
        (lambda: SpeculativeOptions(rollback="redo"), ValueError, "speculation_rollback"),
        (lambda: DelayedOptions(warmup_steps=-1), ValueError, "dpu_warmup_steps"),
        (lambda: DelayedOptions(weight_prediction=1), TypeError, "dpu_weight_prediction"),
        (lambda: OffloadOptions(delayed=DelayedOptions(weight_prediction=True)), ValueError, "cpu_step='delayed'"),
        (lambda: OffloadOptions(speculative="undo"), TypeError, "speculative must be a SpeculativeOptions"),
        (lambda: OffloadOptions(checkpoint_format="zip"), ValueError, "checkpoint_format"),
        (lambda: OffloadOptions(delayed_param_update=True), TypeError, "delayed_param_update"),  # removed
    ],
)
def test_bad_options_name_the_option(build, error, name):
    with pytest.raises(error, match=name):
        build()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [({"init_scale": float("nan")}, ValueError, "loss_scale_init"), ({"hysteresis": 1.5}, TypeError, "hysteresis")],
)
def test_bad_loss_scaler_options_name_the_option(kwargs, error, name):
    with pytest.raises(error, match=name):
        LossScalerConfig(**kwargs)


def test_options_are_frozen_and_grouped_by_schedule():
    options = make_offload_options(cpu_step="delayed", dpu_warmup_steps=3, speculation_rollback="snapshot")
    assert options.delayed == DelayedOptions(warmup_steps=3) and options.speculative == SpeculativeOptions("snapshot")
    for record, name in ((options, "cpu_step"), (options.delayed, "warmup_steps"), (options.loss_scaler, "hysteresis")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, name, 1)
    hash(options)  # frozen all the way down


def test_every_auto_is_resolved_per_device_dtype_and_world():
    cpu = resolve(OffloadOptions(), CPU, torch.bfloat16)
    assert (cpu.cpu_step, cpu.overlap, cpu.in_place, cpu.pin_memory) == ("sync", False, False, False)
    assert cpu.cpu_threads == min(torch.get_num_threads(), CORES) and cpu.notes == ()
    assert resolve(OffloadOptions(), CPU, torch.float32).in_place  # nothing to offload
    accelerator = resolve(OffloadOptions(), CUDA, torch.bfloat16, world_size=2, local_world_size=2)
    assert (accelerator.cpu_step, accelerator.overlap, accelerator.pin_memory) == ("speculative", True, True)
    assert accelerator.cpu_threads == max(1, CORES // 2)
    # a rolled-back step equals sync bitwise by default, whatever the dtype (tests/engine/schedules/test_schedules.py)
    assert accelerator.speculation_rollback == "snapshot" and accelerator.delayed is None
    assert resolve(OffloadOptions(), CUDA, torch.float16).speculation_rollback == "snapshot"
    delayed = resolve(OffloadOptions(cpu_step="delayed", delayed=DelayedOptions(7)), CUDA, torch.bfloat16)
    assert delayed.delayed == DelayedOptions(7) and delayed.speculation_rollback is None
    assert resolve(OffloadOptions(cpu_step="delayed", overlap=True), CPU, torch.bfloat16).overlap
    # The planner passes another machine's cores and torch threads.
    planned = resolve(OffloadOptions(), CPU, torch.bfloat16, 1, 2, cores=64, torch_threads=8)
    assert planned.cpu_threads == 8
    assert resolve(OffloadOptions(), CUDA, torch.bfloat16, 8, 8, cores=64).cpu_threads == 8


def test_combinations_that_cannot_run_are_refused_naming_the_option():
    with pytest.raises(ValueError, match="in_place_on_cpu=True needs.*the device is cuda"):
        resolve(OffloadOptions(in_place_on_cpu=True), CUDA, torch.float32)
    with pytest.raises(ValueError, match="dpu_weight_prediction.*float32.*bf16-mixed"):
        resolve(OffloadOptions(cpu_step="delayed", delayed=DelayedOptions(weight_prediction=True)), CPU, torch.float32)


# (options, device, dtype) -> the option each note must name, and why it does not apply.
DOES_NOT_APPLY = [
    ({"dpu_warmup_steps": 5}, CPU, torch.bfloat16, r"dpu_warmup_steps=5 has no effect.*'delayed' only.*'sync'"),
    ({"dpu_warmup_steps": 5, "cpu_step": "speculative"}, CUDA, torch.bfloat16, r"dpu_warmup_steps=5.*'speculative'"),
    ({"speculation_rollback": "undo"}, CPU, torch.bfloat16, r"speculation_rollback='undo'.*'speculative' only"),
    ({"speculation_rollback": "snapshot", "cpu_step": "delayed"}, CUDA, torch.bfloat16, r"speculation_rollback="),
    ({"overlap": True}, CPU, torch.float32, r"overlap=True has no effect: this run trains in place"),
    ({"overlap": False}, CPU, torch.float32, r"overlap=False has no effect.*in_place_on_cpu=False"),
    ({"loss_scale_init": 8.0, "loss_scale_min": 2.0}, CUDA, torch.bfloat16, r"loss_scale_init=8.0, loss_scale_min="),
    ({"cpu_threads": 10_000}, CPU, torch.bfloat16, rf"cpu_threads=10000 is more than the {CORES} cores"),
]


@pytest.mark.parametrize(("given", "device", "dtype", "note"), DOES_NOT_APPLY)
def test_an_option_that_does_not_apply_is_noted_with_why(given, device, dtype, note):
    (only,) = resolve(make_offload_options(**given), device, dtype).notes
    assert re.search(note, only), only


@pytest.mark.parametrize(
    "given",
    [
        {"cpu_step": "delayed", "dpu_warmup_steps": 5},  # each applies where it is set
        {"cpu_step": "speculative", "speculation_rollback": "undo"},
        {"overlap": False, "in_place_on_cpu": False},
        {"dpu_warmup_steps": 40, "overlap": None},  # the defaults, spelled out: nothing is ignored
    ],
)
def test_options_that_apply_are_not_noted(given):
    assert resolve(make_offload_options(**given), CPU, torch.float32).notes == ()


@pytest.mark.parametrize(("given", "device", "dtype", "note"), [case for case in DOES_NOT_APPLY if case[1] == CPU])
def test_the_engine_warns_once_per_note_also_across_a_replan(given, device, dtype, note):
    net = make_net()
    net[4].requires_grad_(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, dtype, make_offload_options(**given))
        net[4].requires_grad_(True)
        assert engine.replan_if_changed()  # a re-plan builds the parts again, not the options
        engine.close()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len([m for m in messages if re.search(note, m)]) == 1, messages
    assert len(messages) == 1, messages

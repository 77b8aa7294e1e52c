"""The parameter-offload engine's full checkpoint state at one rank (whole tensors, torch AdamW's optimizer
format, the engine's counters) against the uninterrupted run, torch's AdamW and the ZeRO-2 engine. Across
world sizes: tests/checkpoints/test_distributed_ranks.py."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import CPU, options
from offload_params_helpers import (
    FREEZING,
    Blocks,
    batches,
    differences,
    frozen_block_resume_differences,
    full_state,
    loss_of,
    make_engine,
    relative_error,
    sharded_copy,
    train,
    trained_copy,
    training_state,
    two_groups,
)

from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.offload_params.full_state import (
    full_model_state,
    full_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from lightning_zero_offload.warning import ZeroOffloadWarning

# Observed 1.5e-7: the kernels' rounding against torch's AdamW (test_engine.py's bound).
FP32_ROUNDING = 1e-6


@pytest.fixture(autouse=True)
def group(mesh):
    """Every test here runs in the module's one-rank group (conftest.py)."""


def full_checkpoint(sharded, engine, path) -> dict:
    """The three full entries, through a file loaded as a resume loads it (weights_only)."""
    torch.save(
        {
            "state_dict": full_model_state(sharded),
            "optimizer": full_optimizer_state(engine),
            "engine": engine.state_dict(),
        },
        path,
    )
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize(
    ("cpu_state", "cpu_step"), [("fp32", "sync"), ("fp32", "speculative"), ("bf16", "speculative")]
)
def test_a_full_checkpoint_resumes_bitwise_as_the_uninterrupted_run(tmp_path, cpu_state, cpu_step):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cpu_state == "bf16" else torch.float32
    model, data = Blocks(), batches(steps=6, micro=2)
    uninterrupted, engine = trained_copy(model, data, dtype, clip_norm=0.5, cpu_state=cpu_state, cpu_step=cpu_step)
    want = training_state(uninterrupted, engine)

    first, first_engine = trained_copy(model, data[:3], dtype, clip_norm=0.5, cpu_state=cpu_state, cpu_step=cpu_step)
    saved = full_checkpoint(first, first_engine, tmp_path / "full.ckpt")
    torch.manual_seed(1)  # another init and another bf16 rounding seed: everything must come from the file
    resumed = sharded_copy(Blocks(), dtype)
    resumed_engine = make_engine(resumed, cpu_state=cpu_state, cpu_step=cpu_step)
    params = {id(p) for p in resumed.parameters()}
    load_full_model_state(resumed, saved["state_dict"])
    load_full_optimizer_state(resumed_engine, saved["optimizer"])
    resumed_engine.load_state_dict(saved["engine"])
    assert {id(p) for p in resumed.parameters()} == params  # in place: the optimizer's parameters still
    train(resumed, resumed_engine, data[3:], clip_norm=0.5)
    assert differences(training_state(resumed, resumed_engine), want) == []


@pytest.mark.parametrize("cpu_state", ["fp32", "bf16"])
@pytest.mark.parametrize("case", FREEZING)
def test_a_frozen_blocks_state_resumes_as_torch_keeps_it(tmp_path, case, cpu_state):
    """Frozen across the save: its state is saved, loaded into it frozen and taken up when it is unfrozen; trained
    only after the save: it starts afresh. Both bitwise as the uninterrupted run (whose slots never go)."""

    def checkpoint(first, first_engine, resumed, resumed_engine):
        saved = full_checkpoint(first, first_engine, tmp_path / "full.ckpt")
        load_full_model_state(resumed, saved["state_dict"])
        load_full_optimizer_state(resumed_engine, saved["optimizer"])
        resumed_engine.load_state_dict(saved["engine"])

    assert frozen_block_resume_differences(case, cpu_state, checkpoint) == []


def test_the_full_optimizer_state_is_torch_adamws():
    torch.manual_seed(0)
    sharded, engine = trained_copy(Blocks(), batches(steps=3, micro=1), cpu_step="sync")
    ours = full_optimizer_state(engine)
    plain_optimizer = torch.optim.AdamW(two_groups(Blocks()))
    assert ours["param_groups"] == plain_optimizer.state_dict()["param_groups"]
    assert sorted(ours["state"]) == list(range(20))
    assert all(entry["step"].dtype == torch.float32 and float(entry["step"]) == 3 for entry in ours["state"].values())
    plain_optimizer.load_state_dict(ours)  # torch's own loader takes it
    assert torch.equal(plain_optimizer.state_dict()["state"][19]["exp_avg"], ours["state"][19]["exp_avg"])


def test_the_moments_in_torch_format_match_torch_adamws_moments():
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=3, micro=1)
    sharded, engine = trained_copy(model, data, cpu_step="sync")
    ours = full_optimizer_state(engine)["state"]
    reference = torch.optim.AdamW(two_groups(model))
    for window in data:
        for x, y in window:
            ((model(x) - y) ** 2).mean().backward()
        reference.step()
        reference.zero_grad()
    theirs = reference.state_dict()["state"]
    for moment in ("exp_avg", "exp_avg_sq"):
        got = {i: entry[moment] for i, entry in ours.items()}
        assert relative_error(got, {i: entry[moment] for i, entry in theirs.items()}) < FP32_ROUNDING


def test_the_two_modes_resume_from_each_others_full_checkpoints(tmp_path):
    """The same layout as the ZeRO-2 engine's full checkpoint: each mode loads the other's state bitwise."""
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=3, micro=1)
    sharded, engine = trained_copy(model, data, cpu_step="sync")
    saved = full_checkpoint(sharded, engine, tmp_path / "params.ckpt")

    plain = Blocks()
    zero2 = OffloadEngine(torch.optim.AdamW(two_groups(plain)), CPU, torch.float32, options())
    name_of = {id(p): name for name, p in plain.named_parameters()}
    names = [name_of[id(p)] for p in zero2.params]  # the engine's order: the optimizer's
    zero2.load_master_params([saved["state_dict"][name] for name in names])
    zero2.load_optimizer_state_dict(saved["optimizer"])
    zero2.load_state_dict(saved["engine"])
    assert all(torch.equal(w, saved["state_dict"][name]) for name, w in zip(names, zero2.master_params()))
    assert _equal_optimizer_states(zero2.optimizer_state_dict(), saved["optimizer"])
    assert zero2.step_calls == 3

    torch.manual_seed(1)
    back = sharded_copy(Blocks())
    back_engine = make_engine(back, cpu_step="sync")
    load_full_model_state(back, dict(zip(names, zero2.master_params())))
    load_full_optimizer_state(back_engine, zero2.optimizer_state_dict())
    back_engine.load_state_dict(zero2.state_dict())
    assert differences(training_state(back, back_engine), training_state(sharded, engine)) == []
    zero2.close()


def test_with_bf16_state_a_run_carried_into_the_zero2_mode_goes_on_bitwise(tmp_path):
    """Both modes run the same kernel and number each element by its parameter's place among all of the optimizer's
    (the stochastic rounding's counter), so at one rank a bf16-state run resumed in the ZeRO-2 mode from a full
    checkpoint steps bitwise as the offload_params run going on (with numbers of the ZeRO-2 layout, 3.9e-3 off)."""
    torch.manual_seed(0)
    dtype, model, data = torch.bfloat16, Blocks(), batches(steps=5, micro=1)
    sharded, engine = trained_copy(model, data[:3], dtype, cpu_state="bf16", cpu_step="sync")
    saved = full_checkpoint(sharded, engine, tmp_path / "params.ckpt")
    train(sharded, engine, data[3:])

    torch.manual_seed(1)  # another rounding seed: the checkpoint's is taken
    plain = Blocks().to(dtype)
    zero2 = OffloadEngine(torch.optim.AdamW(two_groups(plain)), CPU, dtype, options(cpu_state="bf16"))
    name_of = {id(p): name for name, p in plain.named_parameters()}
    names = [name_of[id(p)] for p in zero2.params]
    zero2.load_master_params([saved["state_dict"][name] for name in names])
    zero2.load_optimizer_state_dict(saved["optimizer"])
    zero2.load_state_dict(saved["engine"])
    for ((x, y),) in data[3:]:
        zero2.expect_step(publish_early=True)
        zero2.begin_backward()
        zero2.scale_loss(loss_of(plain, x.to(dtype), y, 1).float()).backward()
        zero2.finish_backward()
        zero2.step()
        zero2.zero_grad()
    uninterrupted = full_state(sharded)
    assert all(torch.equal(w, uninterrupted[name]) for name, w in zip(names, zero2.master_params(), strict=True))
    assert _equal_optimizer_states(zero2.optimizer_state_dict(), full_optimizer_state(engine))
    zero2.close()


def _equal_optimizer_states(a: dict, b: dict) -> bool:
    return (
        a["param_groups"] == b["param_groups"]
        and sorted(a["state"]) == sorted(b["state"])
        and all(
            torch.equal(a["state"][i][k], b["state"][i][k])
            for i in a["state"]
            for k in ("step", "exp_avg", "exp_avg_sq")
        )
    )


def test_a_bf16_state_loading_fp32_moments_says_it_rounds_them():
    torch.manual_seed(0)
    model, data = Blocks(), batches(steps=2, micro=1)
    sharded, engine = trained_copy(model, data, cpu_step="sync")
    state = full_optimizer_state(engine)
    compact = sharded_copy(model, torch.bfloat16)
    compact_engine = make_engine(compact, cpu_state="bf16")
    with pytest.warns(ZeroOffloadWarning, match=r"torch.float32, this run's cpu_state keeps torch.bfloat16: converted"):
        load_full_optimizer_state(compact_engine, state)
    slot = compact_engine.slots[0]
    assert torch.equal(slot.exp_avg, state["state"][0]["exp_avg"].bfloat16()) and slot.step == 2


def test_the_engine_state_carries_the_counters_and_the_fp16_loss_scaler():
    saved = make_engine(sharded_copy(Blocks()), param_dtype=torch.float16)
    saved.scaler.update(overflow=True)
    saved.step_calls, saved.skipped_steps, saved.nonfinite.consecutive = 7, 2, 1
    loaded = make_engine(sharded_copy(Blocks()), param_dtype=torch.float16)
    fresh_scaler = loaded.scaler.state_dict()
    loaded.load_state_dict(saved.state_dict())
    assert (loaded.step_calls, loaded.skipped_steps, loaded.nonfinite.consecutive) == (7, 2, 1)
    assert loaded.scaler.state_dict() == saved.scaler.state_dict() != fresh_scaler


def test_the_engine_state_carries_the_bf16_rounding_seed_into_a_bf16_run_only():
    torch.manual_seed(12345)  # the bf16 state's rounding seed is torch's initial seed
    saved = make_engine(sharded_copy(Blocks(), torch.bfloat16), cpu_state="bf16")
    torch.manual_seed(1)
    loaded = make_engine(sharded_copy(Blocks(), torch.bfloat16), cpu_state="bf16")
    loaded.load_state_dict(saved.state_dict())
    assert loaded.state_dict()["cpu_state"]["seed"] == 12345
    fp32 = make_engine(sharded_copy(Blocks()))
    fp32.load_state_dict(saved.state_dict())
    assert fp32.state_dict()["cpu_state"] == {"dtype": "fp32", "seed": 0}  # fp32 state rounds nothing


def test_full_state_is_whole_and_loads_back_into_other_values():
    torch.manual_seed(0)
    sharded = sharded_copy(Blocks())
    state = full_model_state(sharded)
    assert all(type(t) is torch.Tensor for t in state.values()) and state.keys() == full_state(sharded).keys()
    changed = {k: v + 1 for k, v in state.items()}
    load_full_model_state(sharded, changed)
    assert all(torch.equal(full_state(sharded)[k], changed[k]) for k in changed)

"""Users' code during fit at two gloo ranks (ZeRO-2 on the offload path) against Lightning's DDP: the
2-rank half of tests/trainer/test_user_code.py and tests/trainer/test_user_optimizers.py.

One launch of two processes runs every case of tests/workers/user_code.py in sequence (a launch
costs more than all of its cases: both ranks import Lightning first); the tests below read its
results. Each zero_offload run is the offload path (``in_place_on_cpu=False``, several buckets) under
``cpu_step="sync"`` and ``"speculative"``; a clamp and EMA also under bf16-mixed (sync); writes also under
``"delayed"``, against one process (its updates are one step stale, so DDP is no reference).

Tolerances: fp32 runs differ from DDP by the order of the gradient reductions only (observed <= 2.2e-7
over 10-30 steps), so they use atol 1e-6 (4.5x margin); a lost write or average differs by its size
(>= 1e-2 here, checked in each case where it could be smaller).
"""

from __future__ import annotations

import functools

import pytest
import torch
from user_code_helpers import CLAMP
from workers import user_code

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]  # launches two processes

ATOL = 1e-6
# One process reduces the global batch in another order than two ranks do (one mean of 16 samples, not
# the mean of two means of 8). Adam's first steps after an unfreeze divide a gradient by its own size, so
# an element with a tiny gradient carries that rounding: observed 1.7e-6 (plain torch, 16 samples at once
# against 2 accumulated batches of 8: 9e-7 on the same parameter). atol 5e-6, 3x margin; a parameter
# left frozen or trained from stale state is off by about lr = 1e-2.
ONE_PROCESS_ATOL = 5e-6
SCHEDULES = list(user_code.SCHEDULES)


@pytest.fixture(scope="module")
def by_rank(tmp_path_factory) -> list[dict]:
    """Every case's results on rank 0 and rank 1 (the only place the launcher is used)."""
    from lightning_zero_offload.testing.ranks import run_ranks

    tmp = tmp_path_factory.mktemp("user_code_ranks")
    # The launch took 2.2-3.7 min on the shared 2-core machine at load 5-14: a hang fails after 10.
    return run_ranks(functools.partial(user_code.run_cases, str(tmp)), 2, tmp, timeout=600)


def case(by_rank: list[dict], name: str) -> dict:
    """Rank 0's runs of case ``name``, after checking that it ran on both ranks and that every
    zero_offload run left the same weights on both (each rank gathers the other's shard at the end)."""
    for rank, results in enumerate(by_rank):
        if name not in results or "error" in results[name]:
            errors = "".join(f"\n{other} raised:\n{r['error']}" for other, r in results.items() if "error" in r)
            pytest.fail(f"case {name!r} did not run to its end on rank {rank}{errors}")
    mine, other = by_rank[0][name], by_rank[1][name]
    for run in [*SCHEDULES, "delayed"]:
        if run in mine:
            for a, b in zip(weights(mine[run]), weights(other[run]), strict=True):
                assert torch.equal(a, b), f"{name}, {run}: the two ranks end with different weights"
    return mine


def weights(run) -> list[torch.Tensor]:
    return run["weights"] if isinstance(run, dict) else run


def max_abs_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(weights(a), weights(b), strict=True))


def assert_same_model(ours, reference, atol: float = ATOL) -> None:
    for index, (a, b) in enumerate(zip(weights(ours), weights(reference), strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m, i=index: f"parameter {i}: {m}")


# -- writes into the parameters ----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["clamp-data", "clamp-through-parameter", "reassign-data", "load-state-dict"])
def test_parameter_writes_between_steps_match_ddp(by_rank, name, schedule):
    runs = case(by_rank, name)
    if name.startswith("clamp"):
        assert min(runs["ddp-largest-before"]) > CLAMP  # every step takes some weight past the clamp
        assert max(float(w.abs().max()) for w in weights(runs[schedule])) <= torch.tensor(CLAMP).item()
    assert_same_model(runs[schedule], runs["ddp"])


def test_a_checkpoint_saved_after_a_write_resumes_as_the_uninterrupted_run(by_rank):
    """Saved at the end of epoch 1 after the clamp wrote the parameters (no step absorbed it yet),
    resumed at two ranks for epoch 2: the uninterrupted 2-epoch run ("clamp-data", sync)."""
    resumed = case(by_rank, "resume-after-a-write")
    assert resumed["steps"] == 20
    assert_same_model(resumed["resumed"], case(by_rank, "clamp-data")["sync"], atol=0)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["weight-averaging", "stochastic-weight-averaging"])
def test_weight_averaging_ends_with_the_average_as_under_ddp(by_rank, name, schedule):
    runs = case(by_rank, name)
    assert max_abs_diff(runs["ddp"], runs["ddp-last-before"]) > 1e-2  # the average is not the last weights
    assert_same_model(runs[schedule], runs["ddp"])


@pytest.mark.parametrize("name", ["bf16-clamp", "bf16-weight-averaging"])
def test_bf16_writes_and_averaging_match_ddp(by_rank, name):
    """bf16 device weights against DDP's autocast over fp32 weights: the same training up to bf16
    rounding (observed 1.8e-3 after 10 steps), atol 5e-3 (2.8x margin). A lost average would cost more
    (DDP's average is 9.6e-2 from its last weights); a lost clamp fails the bound on the weights."""
    runs = case(by_rank, name)
    assert_same_model(runs["sync"], runs["ddp"], atol=5e-3)
    if name == "bf16-weight-averaging":
        assert max_abs_diff(runs["ddp"], runs["ddp-last-before"]) > 4 * 5e-3
    if name == "bf16-clamp":  # the last write survives teardown, within one bf16 ulp (test_user_code.py)
        assert min(runs["ddp-largest-before"]) > CLAMP
        assert max(float(w.abs().max()) for w in weights(runs["sync"])) <= CLAMP * (1 + 2**-7)


# -- the trainable set ------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["unfreeze-requires-grad", "unfreeze-add-param-group", "backbone-finetuning"])
def test_parameters_made_trainable_during_fit_train_as_one_process_on_the_global_batch(by_rank, name, schedule):
    """DDP cannot be the reference (see tests/workers/user_code.py): auto on the global batch is."""
    runs = case(by_rank, name)
    assert_same_model(runs[schedule], runs["auto-global-batch"], atol=ONE_PROCESS_ATOL)
    if name == "backbone-finetuning":
        backbone = slice(0, 4)  # Backbone's two backbone layers come first
        assert max_abs_diff(runs[schedule][backbone], runs["start"][backbone]) > 1e-2


# -- the optimizer -----------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_hooks_fire_as_under_ddp(by_rank, schedule):
    runs = case(by_rank, "step-hooks")
    ours, ddp = runs[schedule], runs["ddp"]
    assert ddp["steps"] == ours["steps"] == 5
    assert ours["calls"] == ddp["calls"] == ["pre", "post"] * 5
    assert ours["global_calls"] == ddp["global_calls"] == ["global pre", "global post"] * 5
    assert ours["users_optimizer"]  # the hooks get the user's optimizer, as torch gives it
    assert_same_model(ours, ddp)  # the pre-hook's LR applies to its own step


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_adamw_subclass_overriding_only_init_trains_as_under_ddp(by_rank, schedule):
    runs = case(by_rank, "subclass")
    assert_same_model(runs[schedule], runs["ddp"])


# -- backward calls, validation, unused parameters ----------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["two-backward-calls", "validation-mid-window"])
def test_backward_calls_unused_parameters_and_validation_mid_window_match_ddp(by_rank, name, schedule):
    runs = case(by_rank, name)
    ours, ddp = runs[schedule], runs["ddp"]
    assert torch.equal(ours["unused"], runs["start_unused"])  # a layer without gradients is never touched
    assert ours["validation_positions"] == ddp["validation_positions"]
    if name == "validation-mid-window":  # validation ran with an accumulation window open
        assert any(position != 0 for position in ddp["validation_positions"])
    assert_same_model(ours, ddp)


# -- the delayed update -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def delayed_one_process() -> dict:
    """The delayed cases in the test process, alone, on the global batch (the reference at one rank)."""
    return user_code.delayed_one_process()


@pytest.mark.parametrize("name", list(user_code.DELAYED_CASES))
def test_writes_under_the_delayed_update_at_two_ranks_match_one_process(by_rank, delayed_one_process, name):
    """cpu_step="delayed" merges writes (tests/trainer/test_user_code.py checks one rank against a plain-torch
    delayed reference); two ranks on the same global batch differ from one process by the order of the
    gradient reductions only: observed <= 1.2e-7, atol 1e-6 (8x margin)."""
    ours = case(by_rank, f"delayed-{name}")["delayed"]
    assert_same_model(ours, delayed_one_process[name]["delayed"])

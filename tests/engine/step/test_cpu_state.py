"""cpu_state="bf16": the engine against a torch reference of the same compact step, bitwise.

The reference keeps its own bf16 weights and moments and calls the bf16-state kernel per parameter, with
each element numbered by its place in the engine's layout; the engine must give the same bits through its
buckets, schedules, threads and checkpoints.
"""

import math
import warnings

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups

from lightning_zero_offload import kernels
from lightning_zero_offload.engine import OffloadEngine
from lightning_zero_offload.engine.optimizer_support import read_hyperparams
from lightning_zero_offload.engine.step.cpu_state import ROUNDING_NUMBERS_TOP, CpuState, rounding_numbers
from lightning_zero_offload.engine.step.layout import build_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SEED = 1234


def as_input(batch, dtype):
    x, y = batch
    return x.to(dtype), y


def compact_engine(dtype=torch.bfloat16, seed=SEED, **kwargs) -> tuple[torch.nn.Module, OffloadEngine]:
    net = make_net()
    torch.manual_seed(seed)  # the rounding seed is torch's initial seed
    return net, OffloadEngine(two_groups(net), CPU, dtype, options(cpu_state="bf16", **kwargs))


def train(net, engine, data, dtype, clip=None, accumulate=1, announce=True):
    for step_batches in zip(*[iter(data)] * accumulate):
        for i, batch in enumerate(step_batches):
            if announce:
                engine.expect_step(i == accumulate - 1, publish_early=True)
            engine.begin_backward()
            loss_fn(net, as_input(batch, dtype)).backward()
            engine.finish_backward()
        engine.step(clip_norm=clip)


class CompactReference:
    """Plain torch: bf16 weights and moments, the engine's gradient rounding, the bf16-state kernel per parameter."""

    def __init__(self, engine_like: OffloadEngine, dtype: torch.dtype) -> None:
        self.net = make_net()
        self.dtype = dtype
        self.optimizer = two_groups(self.net)
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for p in self.params:  # the master is the bf16 rounding; the device parameters hold its values
                p.copy_(p.to(torch.bfloat16))
        self.net.to(dtype)
        self.master = [p.detach().to(torch.bfloat16).clone() for p in self.params]
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.offsets = rounding_numbers([p.numel() for p in self.params])  # each parameter's first element's number
        self.steps = 0
        self.seed = engine_like.state.seed

    def step(self, data, clip=None) -> None:
        grads = [None] * len(self.params)
        for batch in data:
            loss_fn(self.net, as_input(batch, self.dtype)).backward()
            for i, p in enumerate(self.params):  # rounded to bf16 once per backward pass, as the engine's buffer
                # the sum computed in the gradient's precision, rounded once
                grads[i] = p.grad.to(torch.bfloat16) if grads[i] is None else grads[i].add_(p.grad)
                p.grad = None
        sumsq = sum(float(g.double().pow(2).sum()) for g in grads)
        coef = 1.0 if clip is None else min(1.0, clip / (math.sqrt(sumsq) + 1e-6))
        self.steps += 1
        for group_index, group in enumerate(self.optimizer.param_groups):
            hparams = read_hyperparams(self.optimizer, group, group_index)
            for p in group["params"]:
                i = next(j for j, q in enumerate(self.params) if q is p)
                kernels.adam_step_bf16_state(
                    self.master[i].view(-1),
                    grads[i].view(-1),
                    self.exp_avg[i].view(-1),
                    self.exp_avg_sq[i].view(-1),
                    hparams=hparams,
                    step=self.steps,
                    seed=self.seed,
                    offset=self.offsets[i],
                    grad_scale=coef,
                )
                with torch.no_grad():
                    p.copy_(self.master[i])


def assert_engine_equals(engine: OffloadEngine, reference: CompactReference) -> None:
    moments = engine.optimizer_state_dict()["state"]
    for i, (master, ref) in enumerate(zip(engine.master_params(), reference.master)):
        assert master.dtype == torch.bfloat16
        assert torch.equal(master, ref), f"parameter {i}: {(master.float() - ref.float()).abs().max()}"
        assert torch.equal(moments[i]["exp_avg"], reference.exp_avg[i])
        assert torch.equal(moments[i]["exp_avg_sq"], reference.exp_avg_sq[i])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("clip", "accumulate"), [(None, 1), (0.05, 1), (None, 2)])
def test_sync_equals_the_torch_reference_bitwise(dtype, clip, accumulate):
    net, engine = compact_engine(dtype, cpu_step="sync")
    reference = CompactReference(engine, dtype)
    data = batches(8 * accumulate)
    train(net, engine, data, dtype, clip, accumulate)
    for chunk in zip(*[iter(data)] * accumulate):
        reference.step(chunk, clip)
    assert_engine_equals(engine, reference)
    for p, master in zip(engine.params, engine.master_params()):  # the device copy is the master itself
        assert p.dtype == dtype and torch.equal(p.detach(), master.to(dtype))


@pytest.mark.parametrize("clip", [None, 0.05, 100.0])
def test_speculative_equals_sync_bitwise(clip):
    """Clipping at 0.05 triggers every step (every speculated bucket rolls back from its snapshot)."""
    results = {}
    for cpu_step in ("sync", "speculative"):
        net, engine = compact_engine(cpu_step=cpu_step)
        assert engine.resolved.speculation_rollback == ("snapshot" if cpu_step == "speculative" else None)
        train(net, engine, batches(8), torch.bfloat16, clip)
        results[cpu_step] = (engine.master_params(), engine.optimizer_state_dict()["state"])
        if cpu_step == "speculative" and clip is None:
            assert engine.last.speculated_fraction > 0  # the step did run during backward
    for a, b in zip(results["sync"][0], results["speculative"][0]):
        assert torch.equal(a, b)
    for index, entry in results["sync"][1].items():
        assert torch.equal(entry["exp_avg_sq"], results["speculative"][1][index]["exp_avg_sq"])


def test_delayed_runs_one_step_behind_on_compact_state():
    """After the warm-up, step t's update lands at step t+1: the weights after step t are those of t-1's update."""
    net, engine = compact_engine(cpu_step="delayed", dpu_warmup_steps=2)
    sync_net, sync_engine = compact_engine(cpu_step="sync")
    data = batches(6)
    train(net, engine, data, torch.bfloat16)
    engine.sync()
    assert engine.state.grad.dtype == torch.bfloat16
    assert all(m.dtype == torch.bfloat16 for m in engine.master_params())
    train(sync_net, sync_engine, data[:2], torch.bfloat16)  # the warm-up steps are synchronous: equal
    delayed_after_warmup = compact_engine(cpu_step="delayed", dpu_warmup_steps=2)
    train(*delayed_after_warmup, data[:2], torch.bfloat16)
    for a, b in zip(sync_engine.master_params(), delayed_after_warmup[1].master_params()):
        assert torch.equal(a, b)
    assert engine.memory_report()["host_state_bytes"] == 10 * sum(p.numel() for p in engine.params)


def test_thread_count_does_not_change_the_bits():
    results = []
    for threads in (1, 2):
        net, engine = compact_engine(cpu_threads=threads, bucket_size_mb=2**16 / 2**20)
        train(net, engine, batches(6), torch.bfloat16, clip=0.5)
        results.append(engine.master_params())
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_resume_is_bitwise_and_takes_the_saved_seed():
    data = batches(10)
    net, engine = compact_engine()
    train(net, engine, data, torch.bfloat16, clip=0.5)
    expected = engine.master_params()

    first_net, first = compact_engine()
    train(first_net, first, data[:5], torch.bfloat16, clip=0.5)
    saved = (first.master_params(), first.optimizer_state_dict(), first.state_dict())
    assert saved[2]["cpu_state"] == {"dtype": "bf16", "seed": SEED}
    assert saved[1]["state"][0]["exp_avg"].dtype == torch.bfloat16  # saved as held: 6 B/param, not 12

    resumed_net, resumed = compact_engine(seed=99)  # another run's seed: the checkpoint's must win
    resumed.load_master_params(saved[0])
    resumed.load_optimizer_state_dict(saved[1])
    resumed.load_state_dict(saved[2])
    assert resumed.state.seed == SEED
    train(resumed_net, resumed, data[5:], torch.bfloat16, clip=0.5)
    for a, b in zip(expected, resumed.master_params()):
        assert torch.equal(a, b)


def test_fp32_state_converts_to_bf16_and_back_with_a_note():
    fp32_net = make_net()
    fp32 = OffloadEngine(two_groups(fp32_net), CPU, torch.bfloat16, options())
    train(fp32_net, fp32, batches(3), torch.bfloat16)
    state = fp32.optimizer_state_dict()

    _, compact = compact_engine()
    with pytest.warns(UserWarning, match=r"float32.*bfloat16: converted, rounded to nearest \(this resume is not"):
        compact.load_optimizer_state_dict(state)
    compact.load_master_params(fp32.master_params())
    for master, weight in zip(compact.master_params(), fp32.master_params()):
        assert torch.equal(master, weight.to(torch.bfloat16))
    converted = compact.optimizer_state_dict()

    back_net = make_net()
    back = OffloadEngine(two_groups(back_net), CPU, torch.bfloat16, options())
    with pytest.warns(UserWarning, match="bfloat16, this run's cpu_state keeps torch.float32: converted, widened"):
        back.load_optimizer_state_dict(converted)
    for index, entry in back.optimizer_state_dict()["state"].items():
        assert torch.equal(entry["exp_avg"], converted["state"][index]["exp_avg"].float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same dtype: no note
        back.load_optimizer_state_dict(back.optimizer_state_dict())


def test_a_nan_gradient_skips_the_step_bitwise():
    for cpu_step in ("sync", "speculative"):
        net, engine = compact_engine(cpu_step=cpu_step)
        train(net, engine, batches(3), torch.bfloat16)
        before = [t.host.clone() for t in (engine.state.master, engine.state.exp_avg, engine.state.exp_avg_sq)]
        engine.expect_step(publish_early=True)
        engine.begin_backward()
        (loss_fn(net, as_input(batches(1)[0], torch.bfloat16)) * float("nan")).backward()
        with pytest.warns(RuntimeWarning, match="Non-finite gradients"):
            stats = engine.step()
        assert stats.skipped
        for kept, now in zip(before, (engine.state.master, engine.state.exp_avg, engine.state.exp_avg_sq)):
            assert torch.equal(kept, now.host)


def test_host_state_is_8_bytes_per_parameter_in_sync():
    _, engine = compact_engine()
    params = sum(p.numel() for p in engine.params)
    assert engine.memory_report()["host_state_bytes"] == 8 * params
    assert engine.publisher.pool is None  # the bf16 master is published as it is: no low-precision copy


@pytest.mark.parametrize(
    ("kwargs", "dtype", "message"),
    [
        ({}, torch.float16, r"cpu_state='bf16' keeps the master weights in bf16.*precision='bf16-mixed'"),
        (
            {"cpu_step": "speculative", "speculation_rollback": "undo"},
            torch.bfloat16,
            "speculation_rollback='snapshot'",
        ),
        ({"cpu_step": "delayed", "dpu_weight_prediction": True}, torch.bfloat16, "set dpu_weight_prediction=False"),
        ({"in_place_on_cpu": True}, torch.float32, "cpu_state is 'bf16', not 'fp32'"),
    ],
)
def test_what_compact_state_cannot_run_is_refused_naming_the_fix(kwargs, dtype, message):
    with pytest.raises(ValueError, match=message):
        OffloadEngine(two_groups(make_net()), CPU, dtype, options(cpu_state="bf16", **kwargs))


def test_an_unknown_cpu_state_is_refused():
    with pytest.raises(ValueError, match=r"cpu_state must be one of .*'fp32'.*'bf16'"):
        options(cpu_state="fp16")


def element_numbers(state: CpuState) -> dict[tuple[int, int], int]:
    """(parameter, element) -> the rounding number the state's update passes the kernel for it (padding skipped)."""
    found = {}
    for bucket in state.layout.buckets:
        for run, first in state.numbered_runs(bucket, bucket.shard_range):
            for seg in bucket.segments:
                for position in range(max(run.start, seg.shard_start), min(run.stop, seg.shard_end)):
                    found[seg.param_index, seg.param_start + position - seg.shard_start] = first + position - run.start
    return found


SHAPES = [torch.Size(s) for s in ((7, 3), (5,), (11, 2), (1,), (13,))]


@pytest.mark.parametrize("world", [2, 3])
def test_elements_keep_their_numbers_at_any_world_size(world):
    """The rounding bits of an element depend on its number only, so a shard must number its elements as
    one rank numbers the same elements (padding at the end of each bucket is skipped)."""
    one_rank = element_numbers(CpuState(build_layout(SHAPES, bucket_numel=20), [0] * len(SHAPES), keeps_grad=False))
    total = sum(s.numel() for s in SHAPES)
    assert sorted(one_rank.values()) == list(range(ROUNDING_NUMBERS_TOP - total, ROUNDING_NUMBERS_TOP))
    for rank in range(world):
        layout = build_layout(SHAPES, bucket_numel=20, world_size=world, rank=rank)
        assert any(b.padded_numel > b.numel for b in layout.buckets)  # padding to skip
        shard = element_numbers(CpuState(layout, [0] * len(SHAPES), keeps_grad=False))
        assert shard == {key: one_rank[key] for key in shard}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("frozen", [[3], [1, 3], [1, 2, 3]])
def test_elements_keep_their_numbers_when_other_parameters_are_frozen(world, frozen):
    """A frozen parameter leaves the layout but keeps its numbers: the others number as when all are trainable (a
    resume with a block frozen rounds as the uninterrupted run), the runs cut where the frozen one would lie."""
    everything = element_numbers(CpuState(build_layout(SHAPES, bucket_numel=20), [0] * len(SHAPES), keeps_grad=False))
    numbers = rounding_numbers([s.numel() for s in SHAPES])
    trainable = [i for i in range(len(SHAPES)) if i not in frozen]
    cuts = 0
    for rank in range(world):
        layout = build_layout([SHAPES[i] for i in trainable], bucket_numel=48, world_size=world, rank=rank)
        state = CpuState(layout, [0] * len(trainable), False, first_numbers=[numbers[i] for i in trainable])
        for (index, element), number in element_numbers(state).items():
            assert number == everything[trainable[index], element]
        cuts += sum(len(state.numbered_runs(b, b.shard_range)) - 1 for b in layout.buckets)
    assert cuts > 0  # a bucket holds parameters on both sides of a frozen one


def test_auto_keeps_compact_state_at_8_bytes_with_sync_on_an_accelerator():
    """Speculating a bf16 state needs its snapshot (6 B/param more); "auto" is for memory there, fp32 speculates."""
    from lightning_zero_offload.engine.options import resolve

    cuda = torch.device("cuda")
    assert resolve(options(cpu_state="bf16", cpu_step="auto"), cuda, torch.bfloat16).cpu_step == "sync"
    assert resolve(options(cpu_state="fp32", cpu_step="auto"), cuda, torch.bfloat16).cpu_step == "speculative"


@pytest.mark.parametrize("cpu_step", ["sync", "speculative", "delayed"])
def test_a_write_under_fp32_parameters_is_kept_as_the_bf16_master_holds_it(cpu_step):
    """bf16 state under 32-true: a written fp32 value is rounded into the master, and the device takes the
    same rounding before the next forward, so forward, checkpoints and a resume all see one value."""
    kwargs = {"dpu_warmup_steps": 1} if cpu_step == "delayed" else {}
    net, engine = compact_engine(torch.float32, cpu_step=cpu_step, **kwargs)
    train(net, engine, batches(3), torch.float32)
    engine.sync()
    written = torch.full_like(net[2].weight, 1.0 + 2.0**-12)  # not a bf16 value: rounds to 1.0
    with torch.no_grad():
        net[2].weight.copy_(written)
    engine.before_training_forward()  # where the front ends carry writes over
    assert torch.equal(net[2].weight.detach(), written.to(torch.bfloat16).float())  # what the forward sees
    masters = engine.master_params()
    index = next(i for i, p in enumerate(engine.params) if p is net[2].weight)
    assert torch.equal(masters[index], written.to(torch.bfloat16))
    if cpu_step != "delayed":  # delayed: the others are the stale weights training goes on with (docs/dpu.md)
        for p, master in zip(engine.params, masters):
            assert torch.equal(p.detach(), master.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_write_between_backward_and_step_on_a_speculated_bucket_trains_as_sync(dtype):
    """The written bucket was speculated and published during backward: it is rolled back and updated from
    the written values, and what the device was given is compared in the device's dtype (fp32 over bf16)."""
    results = {}
    for cpu_step in ("sync", "speculative"):
        net, engine = compact_engine(dtype, cpu_step=cpu_step)
        for step, batch in enumerate(batches(4)):
            engine.expect_step(publish_early=True)
            engine.begin_backward()
            loss_fn(net, as_input(batch, dtype)).backward()
            engine.finish_backward()
            if step == 2:
                with torch.no_grad():
                    net[4].bias.fill_(0.75)
            engine.step()
        if cpu_step == "speculative":
            assert engine.schedule.rollbacks > 0 and engine.schedule.early_published > 0
        results[cpu_step] = engine.master_params()
    for a, b in zip(results["sync"], results["speculative"]):
        assert torch.equal(a, b)

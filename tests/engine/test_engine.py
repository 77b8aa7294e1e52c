"""The offload engine driven directly (no Trainer), against torch's own optimizers as the reference."""

import copy
import io

import pytest
import torch
from engine_helpers import CPU, batches, loss_fn, make_net, options, two_groups
from torch import nn

from lightning_zero_offload import CPUAdam
from lightning_zero_offload.engine import LossScalerConfig, OffloadEngine, OffloadOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny ops: threads only add barriers


def assert_close_to(net: nn.Module, engine: OffloadEngine, rtol: float, atol: float) -> None:
    for p_ref, master in zip(net.parameters(), engine.master_params()):
        torch.testing.assert_close(master, p_ref.detach(), rtol=rtol, atol=atol)


# fp32 end to end: the only differences from torch come from fp32 rounding inside the fused kernel
# (FMA contraction, operation order), ~1 ulp per step; 30 Adam steps keep parameters within 1e-5
# relative (a wrong hyperparameter, bias correction or clip factor shows up as >1e-3).
RTOL, ATOL = 1e-5, 1e-6


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(torch.optim.AdamW, {}), (torch.optim.Adam, {}), (torch.optim.AdamW, {"maximize": True}), (CPUAdam, {})],
)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_fp32_matches_torch_optimizer(cls, kwargs, clip):
    ref_net, net = make_net(), make_net()
    ref_opt = two_groups(ref_net, cls if cls is not CPUAdam else torch.optim.AdamW, **kwargs)
    engine = OffloadEngine(two_groups(net, cls, **kwargs), CPU, torch.float32, options())
    assert len(engine.layout.buckets) > 2
    for step, batch in enumerate(batches(30)):
        for group in (ref_opt.param_groups[1], engine.optimizer.param_groups[1]):
            group["lr"] = 1e-2 * 0.9**step  # a scheduler: hyperparameters are read live
        loss_fn(ref_net, batch).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref_net.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(net, batch).backward()
        engine.step(clip_norm=clip)
    assert_close_to(ref_net, engine, RTOL, ATOL)
    for p, master in zip(net.parameters(), engine.master_params()):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), master)


def test_gradient_accumulation_and_skipped_params_match_torch():
    """Two micro-batches per step; the last layer gets no gradient on odd steps (torch skips it)."""
    ref_net, net = make_net(), make_net()
    ref_opt = two_groups(ref_net)
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options())

    def forward(model, batch, step):
        x, y = batch
        h = model[:4](x)
        out = model[4](h) if step % 2 == 0 else h[:, :4]
        return nn.functional.cross_entropy(out, y) / 2

    data = batches(40)
    for step in range(20):
        for micro in data[2 * step : 2 * step + 2]:
            forward(ref_net, micro, step).backward()
            forward(net, micro, step).backward()
            engine.finish_backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        engine.step()
    assert_close_to(ref_net, engine, RTOL, ATOL)
    steps = engine.optimizer_state_dict()["state"]
    assert float(steps[0]["step"]) == 20 and float(steps[4]["step"]) == 10  # layer 4 skipped half the steps


def test_clip_by_value_matches_torch():
    ref_net, net = make_net(), make_net()
    ref_opt = torch.optim.AdamW(ref_net.parameters(), lr=1e-2)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=1e-2), CPU, torch.float32, options())
    for batch in batches(10):
        loss_fn(ref_net, batch).backward()
        torch.nn.utils.clip_grad_value_(ref_net.parameters(), 0.01)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(net, batch).backward()
        engine.step(clip_value=0.01)
    assert_close_to(ref_net, engine, RTOL, ATOL)


def test_bf16_device_params_match_fp32_master_reference():
    """Reference: fp32 master + torch AdamW, forward/backward on a bf16 copy under autocast."""
    master_net, device_net, net = make_net(), make_net(), make_net()
    device_net.to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(master_net.parameters(), lr=3e-3)
    engine = OffloadEngine(torch.optim.AdamW(net.parameters(), lr=3e-3), CPU, torch.bfloat16, options())
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    losses = []
    for batch in batches(40):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_fn(device_net, batch).backward()
        for p_master, p_dev in zip(master_net.parameters(), device_net.parameters()):
            p_master.grad = p_dev.grad.float()
            p_dev.grad = None
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            for p_master, p_dev in zip(master_net.parameters(), device_net.parameters()):
                p_dev.copy_(p_master)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(net, batch)
        loss.backward()
        losses.append(loss.item())
        engine.step()
    # Same math, but a 1-ulp fp32 difference in the kernel can flip a bf16 rounding of a weight, which
    # then changes later gradients by about one bf16 ulp (2^-8 relative). After 40 steps at lr 3e-3 the
    # master weights agree to a few 1e-4 absolute; a wrong update (e.g. a missing unscale or a stale
    # copy-back) is off by >1e-2.
    assert_close_to(master_net, engine, rtol=0, atol=2e-3)
    for p, master in zip(net.parameters(), engine.master_params()):
        assert torch.equal(p.detach(), master.to(torch.bfloat16))  # device copy = RNE of the master
    assert sum(losses[-5:]) < sum(losses[:5])


def test_fp16_overflow_skips_step_and_leaves_state_untouched():
    net = make_net().half()
    cfg = LossScalerConfig(init_scale=2.0**10, hysteresis=1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    engine = OffloadEngine(opt, CPU, torch.float16, options(loss_scaler=cfg))
    before_master = [t.clone() for t in engine.master_params()]
    before_device = [p.detach().clone() for p in net.parameters()]
    x = torch.randn(4, 16, dtype=torch.float16)
    engine.scale_loss(net(x).float().sum() * float("inf")).backward()
    stats = engine.step()
    assert stats.skipped and engine.skipped_steps == 1
    assert engine.loss_scale == 2.0**9
    assert all(torch.equal(a, b) for a, b in zip(before_master, engine.master_params()))
    assert all(torch.equal(a, p.detach()) for a, p in zip(before_device, net.parameters()))
    assert engine.optimizer_state_dict()["state"] == {}
    assert not engine.exp_avg.host.any() and not engine.exp_avg_sq.host.any()
    # the next finite step runs and unscales: the update equals an unscaled fp32 AdamW first step (±lr)
    engine.scale_loss(net(x).float().sum()).backward()
    stats = engine.step()
    assert not stats.skipped
    moved = [(a - b).abs().max().item() for a, b in zip(before_master, engine.master_params())]
    assert max(moved) == pytest.approx(1e-2, rel=1e-3)  # Adam's first step moves by lr (x sign)


FP16_SCALER = LossScalerConfig(init_scale=2.0**24, growth_interval=5)  # hysteresis 2


def fp16_steps(net: nn.Module, engine: OffloadEngine, data: list) -> list[tuple[bool, float]]:
    """fp16 forward/backward on the CPU device; (skipped, loss scale after the step) per step."""
    trace = []
    for x, y in data:
        engine.scale_loss(loss_fn(net, (x.half(), y))).backward()
        trace.append((engine.step().skipped, engine.loss_scale))
    return trace


def test_fp16_natural_overflows_lower_the_scale_and_a_resume_restores_it():
    """No injected inf: a loss scale of 2^24 overflows fp16 gradients by itself, so the scale comes
    down, grows back after 5 good steps and overflows again. A resume mid-way (saved through
    torch.save/weights_only as a checkpoint would be) continues bitwise, scaler state included."""
    data, save_at = batches(30), 15

    def fresh() -> tuple[nn.Module, OffloadEngine]:
        net = make_net().half()
        return net, OffloadEngine(two_groups(net), CPU, torch.float16, options(loss_scaler=FP16_SCALER))

    net, full = fresh()
    trace = fp16_steps(net, full, data)
    assert trace[save_at - 1][1] < FP16_SCALER.init_scale  # overflows lowered the scale before the save
    assert any(skipped for skipped, _ in trace[save_at:])  # and it overflows again after it
    assert not all(skipped for skipped, _ in trace[save_at:])

    net, first = fresh()
    assert fp16_steps(net, first, data[:save_at]) == trace[:save_at]
    buffer = io.BytesIO()
    torch.save((first.master_params(), first.optimizer_state_dict(), first.state_dict()), buffer)
    buffer.seek(0)
    masters, optimizer_state, engine_state = torch.load(buffer, weights_only=True)
    assert engine_state["loss_scaler"] == first.scaler.state_dict()

    net, resumed = fresh()
    resumed.load_master_params(masters)
    resumed.load_optimizer_state_dict(optimizer_state)
    resumed.load_state_dict(engine_state)
    assert resumed.loss_scale == first.loss_scale == trace[save_at - 1][1] != FP16_SCALER.init_scale
    assert resumed.scaler.state_dict() == first.scaler.state_dict()
    assert fp16_steps(net, resumed, data[save_at:]) == trace[save_at:]
    assert resumed.skipped_steps == full.skipped_steps
    assert all(torch.equal(a, b) for a, b in zip(full.master_params(), resumed.master_params()))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(full.params, resumed.params))


def test_device_gradient_memory_stays_within_two_buckets():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    bucket_mb = 64 * 65 * 2 / 2**20  # one layer of bf16 gradients per bucket
    engine = OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.bfloat16, options(bucket_size_mb=bucket_mb))
    assert len(engine.layout.buckets) == 8
    worst = []

    def measure(*_):
        live = engine.grads.device_buffers_held * engine.grads.device_buffer_nbytes
        grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)
        worst.append(live + grads)

    for layer in net:
        layer.register_full_backward_hook(measure)
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(x).float().square().mean().backward()
    engine.finish_backward()
    assert len(worst) == 8 and max(worst) <= 2 * engine.grads.device_buffer_nbytes
    assert engine.grads.take_device_buffer_peak() <= 2
    assert all(p.grad is None for p in net.parameters())
    report = engine.memory_report()
    n = report["params"]
    assert report["host_state_bytes"] == 16 * n  # fp32 master, exp_avg, exp_avg_sq, grad
    assert report["device_param_bytes"] == 2 * n  # bf16 on the device, nothing else per parameter
    assert engine.master.dtype == torch.float32 and engine.master.host.device.type == "cpu"


def test_optimizer_state_round_trips_through_torch_adamw():
    ref_net, net = make_net(), make_net()
    engine = OffloadEngine(two_groups(net), CPU, torch.float32, options())
    data = batches(12)
    for batch in data[:6]:
        loss_fn(net, batch).backward()
        engine.step()
    # engine -> torch AdamW
    with torch.no_grad():
        for p_ref, master in zip(ref_net.parameters(), engine.master_params()):
            p_ref.copy_(master)
    ref_opt = two_groups(ref_net)
    ref_opt.load_state_dict(engine.optimizer_state_dict())
    # torch AdamW -> a fresh engine
    net2 = copy.deepcopy(ref_net)
    engine2 = OffloadEngine(two_groups(net2), CPU, torch.float32, options())
    engine2.load_optimizer_state_dict(ref_opt.state_dict())
    for batch in data[6:]:
        loss_fn(ref_net, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(net2, batch).backward()
        engine2.step()
    assert_close_to(ref_net, engine2, RTOL, ATOL)


def test_reentrant_checkpoint_double_hook_is_reported_and_the_fix_it_names_trains():
    """A parameter used inside and outside a checkpointed region: reentrant checkpointing delivers its
    gradient twice (refused); use_reentrant=False, as the message says, matches torch's AdamW."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    ref, fixed = copy.deepcopy(lin), copy.deepcopy(lin)
    x = torch.randn(2, 8, requires_grad=True)
    OffloadEngine(torch.optim.AdamW(lin.parameters()), CPU, torch.float32, options())
    y = torch.utils.checkpoint.checkpoint(lin, lin(x), use_reentrant=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        y.sum().backward()

    engine = OffloadEngine(torch.optim.AdamW(fixed.parameters()), CPU, torch.float32, options())
    torch.utils.checkpoint.checkpoint(fixed, fixed(x), use_reentrant=False).sum().backward()
    engine.step()
    ref_opt = torch.optim.AdamW(ref.parameters())
    torch.utils.checkpoint.checkpoint(ref, ref(x), use_reentrant=False).sum().backward()
    ref_opt.step()
    assert_close_to(ref, engine, RTOL, ATOL)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), TypeError, "cannot run SGD.*torch.optim.AdamW"),
        (lambda ps: torch.optim.LBFGS(ps), TypeError, "LBFGS"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), ValueError, "amsgrad"),
    ],
)
def test_unsupported_optimizers_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        OffloadEngine(make(make_net().parameters()), CPU, torch.float32, options())


def test_invalid_options_name_the_option():
    net = make_net()
    with pytest.raises(ValueError, match="bucket_size_mb"):
        OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, OffloadOptions(bucket_size_mb=0))
    with pytest.raises(ValueError, match="cpu_threads"):
        OffloadEngine(torch.optim.AdamW(net.parameters()), CPU, torch.float32, OffloadOptions(cpu_threads=0))
    frozen = make_net().requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        OffloadEngine(torch.optim.AdamW(frozen.parameters()), CPU, torch.float32, options())


def test_overlap_off_gives_bitwise_the_same_result():
    results = []
    for overlap in (True, False):
        net = make_net()
        engine = OffloadEngine(two_groups(net), CPU, torch.bfloat16, options(overlap=overlap))
        for batch in batches(6):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss_fn(net, batch).backward()
            stats = engine.step()
            assert stats.transfer_s > 0 and stats.cpu_step_s > 0
            if not overlap:  # every bucket moved after backward, on the training thread: none of it hidden
                assert stats.transfer_wait_s == stats.transfer_s and stats.hidden_transfer_fraction == 0
        results.append(engine.master_params())
    assert all(torch.equal(a, b) for a, b in zip(*results))

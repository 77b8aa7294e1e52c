"""ZeroOffloadFabricStrategy under Lightning Fabric's loop API, against plain Fabric and DDP runs.

The loop (tests/workers/fabric_train.py) uses two param groups, an LR scheduler, clipping,
``fabric.backward``, ``optimizer.step()``/``zero_grad()`` and ``fabric.save``/``fabric.load``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from engine_helpers import batches, loss_fn, make_net
from torch import nn
from torch.overrides import TorchFunctionMode
from workers.fabric_train import train

import lightning_zero_offload  # noqa: F401  (registers strategy="zero_offload" for Fabric)
from lightning_zero_offload import (
    ZeroOffloadFabricPrecision,
    ZeroOffloadFabricStrategy,
    convert_checkpoint_to_fp32_state_dict,
)
from lightning_zero_offload.checkpoints import FABRIC_KEY
from lightning_zero_offload.testing.ranks import launch

SCENARIO = Path(__file__).parents[1] / "workers" / "fabric_train.py"


def fabric(strategy="zero_offload", precision="32-true", plugins=None, **options) -> L.Fabric:
    if options:
        strategy = ZeroOffloadFabricStrategy(bucket_size_mb=0.002, **options)  # several buckets
    if plugins:
        precision = None
    f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision, plugins=plugins)
    f.launch()
    return f


def assert_weights_close(ours: dict, ref: dict, rtol: float, atol: float) -> None:
    assert ours["params"].keys() == ref["params"].keys()
    for key, expected in ref["params"].items():
        torch.testing.assert_close(ours["params"][key], expected, rtol=rtol, atol=atol, msg=key)


# Fabric's accumulation recipe (no_backward_sync but for the last micro-batch) without its warning to drop the call.
@pytest.mark.filterwarnings("error::lightning.fabric.utilities.warnings.PossibleUserWarning")
@pytest.mark.parametrize(("clip", "accumulate"), [("norm", 2), ("value", 1)])
def test_32_true_matches_plain_fabric_adamw_with_clipping(clip, accumulate):
    ref = train(fabric("auto"), steps=10, clip=clip, accumulate=accumulate)
    ours = train(fabric(), steps=10, clip=clip, accumulate=accumulate)
    # fp32 end to end; the fused CPU kernel differs from torch AdamW by fp32 rounding only
    assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert_weights_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_string_and_instance_select_the_strategy_and_translate_the_precision():
    f = L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="bf16-mixed")
    assert isinstance(f.strategy, ZeroOffloadFabricStrategy)
    assert isinstance(f.strategy.precision, ZeroOffloadFabricPrecision)
    assert f.strategy.precision.param_dtype == torch.bfloat16
    f = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroOffloadFabricStrategy(bucket_size_mb=1))
    assert f.strategy.options.bucket_size_mb == 1
    assert f.strategy.precision.param_dtype == torch.float32
    with pytest.raises(ValueError, match="bucket_size_mb must be"):
        ZeroOffloadFabricStrategy(bucket_size_mb=0)
    with pytest.raises(ValueError, match="precision='bf16-mixed'"):
        L.Fabric(accelerator="cpu", devices=1, strategy="zero_offload", precision="bf16-true")


def test_setup_keeps_fp32_weights_off_the_device_and_zero_grad_drops_gradients():
    f = fabric(precision="bf16-mixed")
    net = make_net(0)
    reference = [p.detach().clone() for p in net.parameters()]
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert isinstance(optimizer, torch.optim.AdamW)
    batch = batches(1)[0]
    f.backward(loss_fn(model, batch))
    optimizer.zero_grad()  # discards this gradient: the step below has nothing to apply
    optimizer.step()
    masters = f.strategy.master_state_dict(model.module)
    assert all(torch.equal(masters[k], r) for k, r in zip(masters, reference))
    f.backward(loss_fn(model, batch))
    norm = f.clip_gradients(model, optimizer, max_norm=1e-3)
    assert norm > 1e-3
    optimizer.step()
    masters = f.strategy.master_state_dict(model.module)
    assert not torch.equal(next(iter(masters.values())), reference[0])


# The delayed update pending at the save (warm-up over by then): the sharded format had dropped the engine's state
# from Fabric's optimizer entry, so the run went on as sync from the resume (5.8e-2 off the uninterrupted one).
DELAYED = {"cpu_step": "delayed", "dpu_warmup_steps": 2}


@pytest.mark.parametrize("schedule", [{}, DELAYED], ids=["sync", "delayed"])
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_save_load_resumes_bitwise_and_exports_fp32(tmp_path, fmt, schedule):
    options = {"checkpoint_format": fmt, **schedule}
    full = train(fabric(precision="bf16-mixed", **options), steps=10)
    ckpt = tmp_path / "state.ckpt"
    first = train(fabric(precision="bf16-mixed", **options), steps=10, save=str(ckpt), save_at=4)
    assert first["losses"] == full["losses"]
    resumed = train(fabric(precision="bf16-mixed", **options), steps=10, resume=str(ckpt))
    assert resumed["losses"] == full["losses"][4:]  # bitwise: loss scale, moments, step counts, scheduler
    assert all(torch.equal(resumed["params"][k], v) for k, v in full["params"].items())

    exported = convert_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "export.pt")
    assert exported.keys() == full["params"].keys()
    assert all(v.dtype == torch.float32 for v in exported.values())
    if fmt == "sharded":
        assert sorted(p.name for p in (ckpt / "v000001").iterdir()) == ["meta.pt", "shard_00000.pt"]
    else:  # one plain file: plain Fabric with torch AdamW resumes from it
        ref = train(fabric("auto"), steps=10, resume=str(ckpt))
        assert ref["losses"][0] == pytest.approx(resumed["losses"][0], rel=1e-2)


def test_under_the_delayed_update_an_eval_mode_forward_sees_every_step_taken():
    """With cpu_step="delayed" the module's weights run a step behind between steps: an evaluation in a Fabric loop
    (model.eval(), no_grad) computed with them (0.42 off the weights the steps made) where the Trainer syncs first;
    and training goes on as without the evaluation, bitwise. A no-grad forward in train mode does not sync (it may
    sit between a step's forward and backward); ``fabric.strategy.sync()`` brings the module up to date."""

    def run(evaluate: bool) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        f = fabric(**DELAYED)
        net = make_net()
        model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        batch = batches(1)[0]
        x = batch[0]
        gaps = []
        for step in range(8):
            f.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            if evaluate and step in (3, 5):
                steps_made = make_net()
                steps_made.load_state_dict(f.strategy.master_state_dict(model))
                model.eval()
                with torch.no_grad():
                    gaps.append(float((model(x) - steps_made(x)).abs().max()))
                model.train()
        behind = {k: v.clone() for k, v in model.module.state_dict().items()}
        f.strategy.sync()
        return gaps, behind, {k: v.clone() for k, v in model.module.state_dict().items()}

    gaps, _, evaluated = run(evaluate=True)
    assert gaps == [0.0, 0.0]
    _, behind, synced = run(evaluate=False)
    assert all(torch.equal(v, synced[k]) for k, v in evaluated.items())  # the evaluations changed nothing
    assert any(not torch.equal(v, synced[k]) for k, v in behind.items())  # a step behind until sync()


@pytest.mark.slow  # two ranks in processes
def test_an_evaluation_on_one_rank_under_the_delayed_update_warns_instead_of_waiting_for_the_others():
    """At several ranks the sync of an eval-mode forward is a collective: rank 0 evaluating alone timed out in an
    all-gather while rank 1 waited in its backward (a 30-minute hang at the default timeout)."""
    output = launch([sys.executable, str(Path(__file__).parents[1] / "workers" / "fabric_rank0_evaluation.py")], 240)
    assert "rank 0 finished" in output and "rank 1 finished" in output, output[-3000:]
    assert "Call fabric.strategy.sync() on every rank before evaluating" in output


def trained_and_saved_head(f: L.Fabric, path: Path) -> dict[str, torch.Tensor]:
    """Three steps of make_net, then ``fabric.save`` with a filter that keeps the head ("4.*", as a fine-tune keeps
    its adapters); the master weights saved, by name."""
    net = make_net()
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for batch in batches(3):
        f.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    f.save(path, {"model": model, "optimizer": optimizer, "step": 3}, filter={"model": lambda k, v: k[0] == "4"})
    return {k: v.clone() for k, v in f.strategy.master_state_dict(model).items()}


def test_a_filtered_save_keeps_what_the_filter_keeps_and_loads_over_other_weights(tmp_path):
    saved = trained_and_saved_head(fabric(), tmp_path / "head.ckpt")
    assert sorted(torch.load(tmp_path / "head.ckpt", weights_only=True)["model"]) == ["4.bias", "4.weight"]
    f = fabric()
    net = make_net(seed=1)
    model, _ = f.setup(net, torch.optim.AdamW(net.parameters()))
    left = f.load(tmp_path / "head.ckpt", {"model": model}, strict=False)  # as plain Fabric loads a filtered one
    assert left == {"optimizer": left["optimizer"], "step": 3}
    loaded, fresh = f.strategy.master_state_dict(model), make_net(seed=1).state_dict()
    assert all(torch.equal(loaded[k], saved[k] if k[0] == "4" else fresh[k]) for k in fresh)


def test_a_sharded_save_refuses_to_filter_the_weights_and_writes_nothing(tmp_path):
    with pytest.raises(ValueError, match=r"filters \['model'\].*checkpoint_format='full'"):
        trained_and_saved_head(fabric(checkpoint_format="sharded"), tmp_path / "head.ckpt")
    assert not (tmp_path / "head.ckpt").exists()


@pytest.mark.filterwarnings(  # the first steps overflow and are skipped: torch warns as it does under AMP
    "ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`"
)
def test_fp16_loss_scale_lowered_by_natural_overflows_resumes(tmp_path):
    """A loss scale of 2^20 overflows fp16 gradients by itself (no injected inf): the scale comes down
    before the save, grows back (every 4 good steps) and overflows again after it."""
    fp16 = [ZeroOffloadFabricPrecision("16-mixed")]  # on the CPU Fabric turns precision="16-mixed" into bf16
    scaler = {"loss_scale_init": 2.0**20, "loss_scale_growth_interval": 4}
    ckpt = str(tmp_path / "fp16.ckpt")
    f = fabric(plugins=fp16, **scaler)
    full = train(f, steps=16, save=ckpt, save_at=8)
    saved = torch.load(ckpt, weights_only=True)["optimizer"]["zero_offload_engine"]
    assert saved["loss_scaler"]["scale"] < scaler["loss_scale_init"] and saved["skipped_steps"] > 0
    assert f.strategy.session.skipped_steps > saved["skipped_steps"]  # overflows after the save too

    loaded = fabric(plugins=fp16, **scaler)
    train(loaded, steps=8, resume=ckpt)  # loads and runs no step
    assert loaded.strategy.session.engine_state_dict()["loss_scaler"] == saved["loss_scaler"]
    g = fabric(plugins=fp16, **scaler)
    resumed = train(g, steps=16, resume=ckpt)
    assert resumed["losses"] == full["losses"][8:]
    assert all(torch.equal(resumed["params"][k], v) for k, v in full["params"].items())
    assert g.strategy.session.loss_scale == f.strategy.session.loss_scale


@pytest.mark.slow  # a model nobody here wrote: litgpt is the slow tier's install (Makefile, MODELS)
def test_litgpt_learns_under_bf16_mixed():
    from litgpt.config import Config
    from litgpt.model import GPT

    f = fabric(precision="bf16-mixed")
    torch.manual_seed(0)
    config = Config(block_size=16, vocab_size=64, padded_vocab_size=64, n_layer=2, n_head=2, n_embd=32)
    model = GPT(config)
    model, optimizer = f.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 64, (4, 1), generator=g)
    sequences = (start + torch.randint(1, 3, (4, 17), generator=g).cumsum(1)) % 64  # learnable
    losses = []
    for _ in range(16):
        logits = model(sequences[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), sequences[:, 1:].reshape(-1))
        f.backward(loss)
        f.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-4:]) < 0.7 * sum(losses[:4])


def litgpt_lora_finetune(strategy, path: Path) -> dict[str, torch.Tensor]:
    """litgpt's LoRA recipe on pythia-14m's shape: the base frozen, adapters on query, value, MLP and head trained by
    AdamW(fused=True) in Fabric's accumulation loop with clipping, then ``fabric.save`` with litgpt's ``lora_filter``.
    What was saved (the adapters), and every weight by name."""
    from litgpt.lora import GPT, Config, lora_filter, mark_only_lora_as_trainable

    adapters = {f"lora_{where}": True for where in ("query", "value", "mlp", "head")}
    f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
    f.launch()
    torch.manual_seed(0)
    model = GPT(Config.from_name("pythia-14m", lora_r=4, lora_alpha=8, **adapters))
    mark_only_lora_as_trainable(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = f.setup(model, torch.optim.AdamW(trained, lr=2e-3, weight_decay=0.02, fused=True))
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        for micro in range(2):
            tokens = torch.randint(0, 1000, (2, 33), generator=generator)
            with f.no_backward_sync(model, enabled=micro == 0):
                logits = model(tokens[:, :-1])
                f.backward(nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / 2)
        f.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
    f.save(path, {"model": model}, filter={"model": lora_filter})
    weights = {f"weights/{name}": p.detach().clone() for name, p in model.named_parameters()}
    return {**weights, **{f"saved/{k}": v for k, v in torch.load(path, weights_only=True)["model"].items()}}


@pytest.mark.slow  # a model nobody here wrote: litgpt is the slow tier's install (Makefile, MODELS)
@pytest.mark.usefixtures("own_process_group")  # conftest.py: offload_params' group ends with the test
@pytest.mark.parametrize(
    "options",
    [{"in_place_on_cpu": False, "cpu_step": "speculative"}, {"offload_params": True}],
    ids=["zero2-speculative", "params"],
)
def test_litgpts_lora_finetuning_is_plain_fabrics_bitwise(options, tmp_path):
    """The CPU step is torch's fused AdamW's arithmetic: adapters, frozen base and the filtered save all bitwise."""
    reference = litgpt_lora_finetune("auto", tmp_path / "auto.pth")
    ours = litgpt_lora_finetune(ZeroOffloadFabricStrategy(**options), tmp_path / "ours.pth")
    assert ours.keys() == reference.keys() and any(key.startswith("saved/") for key in ours)
    for key, value in reference.items():
        mine = ours[key].full_tensor() if hasattr(ours[key], "full_tensor") else ours[key]
        assert torch.equal(mine, value), key


def train_at_two_ranks(tmp: Path, runs: dict[str, dict]) -> dict[str, dict]:
    """``runs`` (name: options, as tests/workers/fabric_train.py takes them) one after another in one
    launch of two ranks; what rank 0 wrote for each, by name."""
    specs = [{**run, "out": str(tmp / f"{name}.pt")} for name, run in runs.items()]
    (tmp / "runs.json").write_text(json.dumps(specs))
    launch([sys.executable, str(SCENARIO), "--devices", "2", "--runs", str(tmp / "runs.json")], 300 + 60 * len(runs))
    return {name: torch.load(tmp / f"{name}.pt", weights_only=True) for name in runs}


@pytest.mark.slow  # two ranks in processes
def test_two_ranks_match_ddp_and_sharded_checkpoint_resumes_at_one(tmp_path):
    """Two micro-batches a step in Fabric's recipe: DDP skips its first all-reduce, zero_offload reduces both."""
    ckpt = tmp_path / "two.ckpt"
    zero = {"format": "sharded", "save": str(ckpt), "save_at": 6, "accumulate": 2}
    ddp, ours = train_at_two_ranks(tmp_path, {"ddp": {"strategy": "ddp", "accumulate": 2}, "zero": zero}).values()
    assert_weights_close(ours, ddp, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in (ckpt / "v000001").iterdir()) == ["meta.pt", "shard_00000.pt", "shard_00001.pt"]
    resumed = train(fabric(checkpoint_format="sharded"), steps=12, resume=str(ckpt), accumulate=4)
    assert_weights_close(resumed, ours, rtol=1e-5, atol=1e-6)  # one rank: fp32 reduction order only


def _fabric_loop(cpu_step: str, announce: bool) -> tuple[list[torch.Tensor], list[float]]:
    f = fabric(cpu_step=cpu_step, in_place_on_cpu=False)
    net = make_net()
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    speculated = []
    for batch in batches(6):
        if announce:  # a step follows this backward, and nothing reads the weights in between
            f.strategy.expect_step(publish_early=True)
        f.backward(loss_fn(model, batch))
        optimizer.step()
        optimizer.zero_grad()
        speculated.append(f.strategy.last_step_stats.speculated_fraction)
    return [p.detach().clone() for p in model.parameters()], speculated


def test_the_speculative_step_under_fabric_runs_when_the_step_is_announced():
    """Fabric cannot know that a step follows a backward: unannounced, the speculative schedule runs as sync
    (nothing speculated); announced, it speculates, with sync's results."""
    sync, _ = _fabric_loop("sync", announce=False)
    quiet, unannounced = _fabric_loop("speculative", announce=False)
    spec, announced = _fabric_loop("speculative", announce=True)
    # announced, it speculates (its chooser may time a few steps as sync where the snapshot came late)
    assert max(unannounced) == 0 and announced[0] > 0 and sum(announced) >= len(announced) / 2
    for a, b, c in zip(sync, quiet, spec):
        assert torch.equal(a, b) and torch.equal(a, c)


def _train_steps(f: L.Fabric, model, optimizer, steps: int, first_batch: int = 0) -> None:
    for batch in batches(first_batch + steps)[first_batch:]:
        f.backward(loss_fn(model, batch))
        f.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()


def _assert_state_dicts_equal(ours: dict, expected: dict) -> None:
    assert ours.keys() == expected.keys()
    for key, tensor in expected.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key


def test_strategy_methods_take_the_model_fabric_returned(tmp_path):
    """``fabric.setup`` returns a ``_FabricModule``: master_state_dict, get_module_state_dict,
    load_module_state_dict and save/load_checkpoint treat it as the module it wraps."""
    f = fabric(precision="bf16-mixed")
    net = make_net(0)
    model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    _train_steps(f, model, optimizer, 3)
    masters = f.strategy.master_state_dict(model.module)
    assert {v.dtype for v in masters.values()} == {torch.float32}
    assert {v.dtype for v in model.state_dict().values()} == {torch.bfloat16}  # the device copies
    _assert_state_dicts_equal(f.strategy.master_state_dict(model), masters)
    _assert_state_dicts_equal(f.strategy.get_module_state_dict(model), masters)

    def assert_restored() -> None:  # the masters, and the device copies made from them
        _assert_state_dicts_equal(f.strategy.master_state_dict(model), masters)
        _assert_state_dicts_equal(model.state_dict(), {k: v.bfloat16() for k, v in masters.items()})

    state = {"model": model, "optimizer": optimizer}
    through_fabric, through_strategy = tmp_path / "fabric.ckpt", tmp_path / "strategy.ckpt"
    f.save(through_fabric, state)
    f.strategy.save_checkpoint(through_strategy, state)
    for path in (through_fabric, through_strategy):
        saved = torch.load(path, weights_only=True)
        assert saved[FABRIC_KEY] == {"model": "model", "optimizer": "optimizer"}
        _assert_state_dicts_equal(saved["model"], masters)

    _train_steps(f, model, optimizer, 1, first_batch=3)
    f.load(through_fabric, state)
    assert_restored()
    _train_steps(f, model, optimizer, 1, first_batch=3)
    f.strategy.load_checkpoint(through_strategy, state)
    assert_restored()
    _train_steps(f, model, optimizer, 1, first_batch=3)
    f.strategy.load_module_state_dict(model, masters)
    assert_restored()


def _train_set_up(how: str, precision: str, **options) -> tuple[dict, set]:
    """Three steps after ``fabric.setup(model, optimizer)`` (``how="setup"``) or the two-call form with the
    optimizer built before or after ``setup_module``; the master weights and the device copies' dtypes."""
    f = fabric(precision=precision, **options)
    net = make_net(0)
    if how == "setup":
        model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    elif how == "optimizer before setup_module":
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
        model = f.setup_module(net)
        optimizer = f.setup_optimizers(optimizer)
    else:
        model = f.setup_module(net)
        optimizer = f.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    _train_steps(f, model, optimizer, 3)
    return f.strategy.master_state_dict(model), {p.dtype for p in model.parameters()}


@pytest.mark.parametrize(
    ("precision", "options", "device_dtype"),
    [("32-true", {"in_place_on_cpu": False}, torch.float32), ("bf16-mixed", {}, torch.bfloat16)],
)
@pytest.mark.parametrize("how", ["optimizer before setup_module", "optimizer after setup_module"])
def test_setup_module_then_setup_optimizers_trains_as_setup(how, precision, options, device_dtype):
    expected, expected_dtypes = _train_set_up("setup", precision, **options)
    ours, dtypes = _train_set_up(how, precision, **options)
    assert expected_dtypes == dtypes == {device_dtype}
    assert not torch.equal(expected["0.weight"], make_net(0)[0].weight)  # it trained
    _assert_state_dicts_equal(ours, expected)


class _RecordsMoves(TorchFunctionMode):
    """Records the ``Tensor.to`` calls given one of ``tensors`` (as ``module.to(device)`` makes for each
    parameter; on the CPU they move nothing, on an accelerator they copy the weights in their dtype)."""

    def __init__(self, tensors) -> None:
        super().__init__()
        self.watched = {id(t) for t in tensors}
        self.moved: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and id(args[0]) in self.watched:
            self.moved.append(id(args[0]))
        return func(*args, **(kwargs or {}))


def test_setup_module_keeps_the_trainable_weights_on_the_host_until_an_optimizer_or_a_forward():
    """Until setup_optimizers, the trainable fp32 weights do not move to the device (as with fabric.setup);
    a forward before it is evaluation: the weights move once, as they are, and training still needs the optimizer."""
    f = fabric(precision="bf16-mixed")
    net = make_net(0)
    with _RecordsMoves(net.parameters()) as spy:
        model = f.setup_module(net)
    assert spy.moved == []
    with _RecordsMoves(net.parameters()) as spy:
        loss = loss_fn(model, batches(1)[0])
        loss_fn(model, batches(1)[0])
    assert sorted(spy.moved) == sorted(id(p) for p in net.parameters())  # once each, at the first forward
    with pytest.raises(RuntimeError, match=r"call fabric.setup_optimizers\(optimizer\) after setup_module"):
        f.backward(loss)
    optimizer = f.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))  # still possible
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    _train_steps(f, model, optimizer, 1)


def test_two_call_setup_refuses_what_cannot_train():
    f = fabric()
    net = make_net(0)
    with pytest.raises(RuntimeError, match=r"zero_offload .* Call model = fabric.setup_module\(model\) first"):
        f.setup_optimizers(torch.optim.AdamW(net.parameters()))  # before setup_module
    outer = nn.Sequential(net, nn.Linear(4, 4))
    f.setup_module(net)
    f.setup_module(outer)
    with pytest.raises(ValueError, match=r"zero_offload .* model, optimizer = fabric.setup\(model, optimizer\)"):
        f.setup_optimizers(torch.optim.AdamW(net.parameters()))  # which model? net and outer hold them all

    g = fabric()
    net = make_net(0)
    model = g.setup_module(net)
    first, second = torch.optim.AdamW(net[0].parameters()), torch.optim.AdamW(net[2].parameters())
    with pytest.raises(RuntimeError, match=r"zero_offload trains one optimizer per Fabric.*param groups of one"):
        g.setup_optimizers(first, second)
    with pytest.raises(RuntimeError, match=r"zero_offload trains one optimizer per Fabric"):
        g.setup_optimizers(torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("two_calls", [False, True])
def test_init_module_empty_init_builds_on_the_meta_device_and_trains_as_the_eager_build(two_calls):
    """The optimizer built over the meta parameters (one call) or over the set-up module's (two calls): the
    engine takes the model block by block, and it trains bitwise as the model built eagerly with that seed."""
    from offload_params_helpers import Blocks, batches, loss_of, two_groups

    def fit(empty_init: bool) -> dict[str, torch.Tensor]:
        strategy = ZeroOffloadFabricStrategy(in_place_on_cpu=False)
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed")
        fabric.launch()
        torch.manual_seed(0)
        with fabric.init_module(empty_init=empty_init):
            model = Blocks()
        assert all(p.is_meta for p in model.parameters()) == empty_init
        if two_calls:
            model = fabric.setup_module(model)
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(two_groups(model)))
        else:
            model, optimizer = fabric.setup(model, torch.optim.AdamW(two_groups(model)))
        for window in batches(steps=3, micro=2):
            for x, y in window:
                fabric.backward(loss_of(model, x, y, len(window)))
            fabric.clip_gradients(model, optimizer, max_norm=0.3)
            optimizer.step()
            optimizer.zero_grad()
        fabric.strategy.session.sync()
        return {k: v.clone() for k, v in fabric.strategy.session.master_state_dict().items()}

    got, want = fit(empty_init=True), fit(empty_init=False)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_model_on_the_meta_device_used_before_its_optimizer_is_set_up_behaves_as_built_eagerly(tmp_path):
    """Loaded after init_module(empty_init=True), evaluated or loaded into before setup_optimizers, and an
    evaluation-only model built on the meta device beside the trained one: each as if built eagerly."""

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))

    def fabric() -> L.Fabric:
        made = L.Fabric(strategy=ZeroOffloadFabricStrategy(), accelerator="cpu", devices=1)
        made.launch()
        return made

    torch.manual_seed(0)
    reference, x = net(), torch.randn(4, 8)
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    want = reference(x)

    loaded = fabric()  # Fabric's documented pattern for empty_init: load, then set up
    with loaded.init_module(empty_init=True):
        model = net()
    model.load_state_dict(torch.load(tmp_path / "weights.pt"))
    model, _ = loaded.setup(model, torch.optim.AdamW(model.parameters(), lr=0.0))
    assert torch.allclose(model(x).float(), want)

    evaluated = fabric()  # a forward before setup_optimizers: the values drawn then, whole on the device
    with evaluated.init_module(empty_init=True):
        model = evaluated.setup_module(net())
    torch.manual_seed(1)
    eager = net()(x)
    torch.manual_seed(1)
    assert torch.equal(model(x), eager)
    evaluated.setup_optimizers(torch.optim.AdamW(model.parameters()))  # and then it trains as usual

    raw = fabric()  # fabric.load_raw into the set-up module, then its optimizer
    with raw.init_module(empty_init=True):
        model = raw.setup_module(net())
    raw.load_raw(tmp_path / "weights.pt", model)
    raw.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.0))
    assert torch.allclose(model(x).float(), want)

    with raw.init_module(empty_init=True):  # beside the trained model: evaluation only
        teacher = net()
    teacher = raw.setup_module(teacher)
    raw.load_raw(tmp_path / "weights.pt", teacher)
    assert torch.allclose(teacher(x).float(), want)


def test_a_meta_module_set_up_and_dropped_is_released():
    import gc
    import weakref

    fabric = L.Fabric(strategy=ZeroOffloadFabricStrategy(), accelerator="cpu", devices=1)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = fabric.setup_module(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)))
    released = weakref.ref(model.module)
    del model
    gc.collect()
    assert released() is None


class ScaleNorm(nn.Module):
    """A norm as Hugging Face writes them: no reset_parameters (nothing can initialize it on the meta device)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.register_buffer("running", torch.zeros(width))  # persistent: in the state dict
        self.register_buffer("cache", torch.arange(float(width), device="cpu"), persistent=False)  # real on meta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.running + self.cache


@pytest.mark.parametrize("assign", [False, True])
def test_a_load_before_setup_fills_what_it_holds_without_initializing_anything(assign):
    """load_state_dict after fabric.init_module(empty_init=True), copying or assigning: only what the load holds
    gets memory (a norm nothing could initialize included), and the model trains with the loaded values."""

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), ScaleNorm(4), nn.Linear(4, 1))

    torch.manual_seed(0)
    reference = net()
    reference[1].running.fill_(7.0)
    fabric = L.Fabric(strategy=ZeroOffloadFabricStrategy(), accelerator="cpu", devices=1)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = net()
    model.load_state_dict(reference.state_dict(), assign=assign)
    assert not any(t.is_meta for t in model.state_dict().values())
    model, _ = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.0))
    x = torch.randn(3, 4)
    assert torch.equal(model(x), reference(x))
    assert torch.equal(model.module[1].running, reference[1].running)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_a_device_share_of_the_buckets_trains_as_none(clip):
    """The ZeRO-2 mode's share under Fabric: the last buckets step on the device, the weights are the same."""
    want = train(fabric(in_place_on_cpu=False), steps=6, clip=clip)
    f = fabric(in_place_on_cpu=False, device_share=0.5)
    got = train(f, steps=6, clip=clip)
    assert f.strategy.session.engine.memory_report()["device_share_params"] > 0
    assert_weights_close(got, want, rtol=1e-6, atol=0)

"""A full-format save writes the engine's own buffers: no second copy of the fp32 state while it runs,
a file that still loads without this package, and copies for a writer that may finish later."""

import os
import subprocess
import sys
import threading
import time

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO as FabricTorchIO
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from lightning_zero_offload import ZeroOffloadFabricStrategy, ZeroOffloadStrategy


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class DuringFit(L.Callback):
    """Runs ``check(trainer)`` after step ``at``, while the engine holds training's buffers."""

    def __init__(self, check, at: int = 2) -> None:
        self.check, self.at, self.ran = check, at, False

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            self.check(trainer)
            self.ran = True


def fit_with(check, checkpoint_io=None, **kwargs) -> Classifier:
    callback = DuringFit(check)
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(checkpoint_io=checkpoint_io, **kwargs),
        precision="bf16-mixed",
        max_steps=4,
        callbacks=[callback],
        **QUIET,
    )
    model = Classifier()
    trainer.fit(model, loader())
    assert callback.ran
    return model


def test_the_full_format_checkpoint_holds_views_of_the_engine_buffers_at_one_rank():
    """No clone: every weight and moment in the checkpoint dict is the engine's own storage."""

    def check(trainer):
        engine = trainer.strategy.engine
        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
        weights = [checkpoint["state_dict"][keys[0]] for keys in trainer.strategy._param_keys]
        assert {storage_of(w) for w in weights} == {storage_of(engine.master)}
        moments = [
            t for s in checkpoint["optimizer_states"][0]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])
        ]
        assert len(moments) == 2 * len(weights)
        assert {storage_of(t) for t in moments} == {storage_of(engine.exp_avg), storage_of(engine.exp_avg_sq)}
        for keys, weight, param in zip(trainer.strategy._param_keys, weights, engine.params):
            assert weight.shape == param.shape and weight.dtype == torch.float32, keys

    fit_with(check)


def test_a_user_checkpoint_io_gets_copies_it_may_keep_or_write_later():
    """A plugin may write in the background (AsyncCheckpointIO) or keep the tensors: they must not change."""

    def check(trainer):
        engine = trainer.strategy.engine
        checkpoint = trainer._checkpoint_connector.dump_checkpoint()
        buffers = {storage_of(b) for b in (engine.master, engine.exp_avg, engine.exp_avg_sq)}
        tensors = list(checkpoint["state_dict"].values()) + [
            t for s in checkpoint["optimizer_states"][0]["state"].values() for t in (s["exp_avg"], s["exp_avg_sq"])
        ]
        assert not buffers & {storage_of(t) for t in tensors}

    class MyIO(TorchCheckpointIO):
        pass

    fit_with(check, checkpoint_io=MyIO())


@pytest.mark.slow  # a fresh interpreter loads the file
def test_the_file_saved_from_the_buffers_loads_without_this_package_and_training_is_unchanged(tmp_path):
    path = tmp_path / "mid.ckpt"
    saved = {}

    def check(trainer):
        trainer.save_checkpoint(path)
        keys = trainer.strategy._param_keys
        saved["master"] = {k[0]: w.clone() for k, w in zip(keys, trainer.strategy.engine.master_params())}

    model = fit_with(check)
    reference = Classifier()  # the same run without a save in the middle
    L.Trainer(strategy=ZeroOffloadStrategy(), precision="bf16-mixed", max_steps=4, **QUIET).fit(reference, loader())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    loaded = torch.load(path, weights_only=True)
    assert len(saved["master"]) == len(list(model.parameters()))
    for name, master in saved["master"].items():
        assert torch.equal(loaded["state_dict"][name], master), name
    # A process that never imports lightning_zero_offload rebuilds the module from the file.
    script = (
        "import sys, torch\n"
        "sys.modules['lightning_zero_offload'] = None  # importing it would fail\n"
        "from helpers import Classifier\n"
        f"model = Classifier.load_from_checkpoint({str(path)!r}, map_location='cpu')\n"
        f"expected = torch.load({str(path)!r}, weights_only=True)['state_dict']\n"
        "assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())\n"
        "print('loaded', len(expected))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])  # 4.2M parameters

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).float().pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_a_full_save_at_one_rank_adds_under_1_byte_per_parameter_of_host_memory(tmp_path):
    """It used to add a copy of the master and both moments (about 12 B/param) while it ran."""
    params = sum(p.numel() for p in Wide().parameters())
    measured = {}

    def check(trainer):
        peak, done = [rss()], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.0005)

        before = rss()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        trainer.save_checkpoint(tmp_path / "w.ckpt")
        done.set()
        sampler.join()
        measured["extra"] = max(peak[0], rss()) - before

    callback = DuringFit(check, at=1)
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(in_place_on_cpu=False),
        precision="bf16-mixed",
        max_steps=2,
        callbacks=[callback],
        **QUIET,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 1024)), batch_size=4)
    trainer.fit(Wide(), data)
    assert measured["extra"] < params, f"{measured['extra'] / params:.2f} B/param during the save"
    assert torch.load(tmp_path / "w.ckpt", weights_only=True)["state_dict"]["net.0.weight"].shape == (1024, 1024)


def test_fabric_full_save_writes_the_engine_buffers_and_loads_back(tmp_path, monkeypatch):
    import lightning_zero_offload.fabric as fabric_module

    written = {}
    real_atomic_save = fabric_module.atomic_save

    def record(checkpoint, path):
        written["checkpoint"] = checkpoint
        real_atomic_save(checkpoint, path)

    monkeypatch.setattr(fabric_module, "atomic_save", record)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroOffloadFabricStrategy(), precision="bf16-mixed")
    fabric.launch()
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(4, 8)).float().sum())
    optimizer.step()
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": optimizer})
    engine = fabric.strategy.engine
    state_dict = written["checkpoint"]["model"]
    assert {storage_of(state_dict[k]) for k in ("0.weight", "2.bias")} == {storage_of(engine.master)}
    loaded = torch.load(tmp_path / "f.ckpt", weights_only=True)
    for key, master in zip(("0.weight", "0.bias", "2.weight", "2.bias"), engine.master_params()):
        assert torch.equal(loaded["model"][key], master), key
    assert type(fabric.strategy.checkpoint_io) is FabricTorchIO

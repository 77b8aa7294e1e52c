"""Where the strategy's checkpoints go and how they load: fsspec paths, a user's CheckpointIO,
``fit(weights_only=False)``, and Lightning versions whose loaders take no ``weights_only``."""

import inspect
import pathlib

import fsspec
import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.engine.checkpoint import CheckpointError


def run(fmt, epochs, ckpt_path=None, model=None, checkpoint_io=None, fit_kwargs=None, **kwargs):
    """``epochs`` epochs of 4 steps."""
    model = model or Classifier()
    strategy = ZeroOffloadStrategy(checkpoint_format=fmt, checkpoint_io=checkpoint_io)
    trainer = L.Trainer(strategy=strategy, max_epochs=epochs, **{**QUIET, **kwargs})
    trainer.fit(model, loader(n=32), ckpt_path=ckpt_path, **(fit_kwargs or {}))
    return model, trainer


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_remote_paths_go_through_fsspec_and_resume(tmp_path, monkeypatch, fmt):
    monkeypatch.chdir(tmp_path)  # a path mistaken for a local one would appear here
    root = f"memory://zero-offload-tests/{tmp_path.name}"
    full, _ = run(fmt, 2)
    run(fmt, 1, default_root_dir=root, enable_checkpointing=True)
    fs = fsspec.filesystem("memory")
    saved = fs.find(f"{root}/checkpoints")
    if fmt == "full":
        assert [p.rsplit("/", 1)[1] for p in saved] == ["epoch=0-step=4.ckpt"]
    else:
        assert sorted(p.rsplit("/", 2)[1:] for p in saved) == [
            ["v000001", "meta.pt"],
            ["v000001", "shard_00000.pt"],
        ]
    assert list(tmp_path.iterdir()) == []
    resumed, _ = run(fmt, 2, ckpt_path=f"{root}/checkpoints/epoch=0-step=4.ckpt")
    assert resumed.losses == full.losses[4:]
    assert_same_params(full, resumed)


class RecordingIO(TorchCheckpointIO):
    """A user's CheckpointIO, with Lightning 2.4/2.5's ``load_checkpoint`` signature (no weights_only)."""

    def __init__(self):
        self.calls = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", str(path)))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location=None):
        self.calls.append(("load", str(path)))
        return torch.load(path, map_location="cpu", weights_only=True)


def test_a_custom_checkpoint_io_writes_and_reads_the_full_format(tmp_path):
    io = RecordingIO()
    full, _ = run("full", 2)
    _, trainer = run("full", 1, checkpoint_io=io)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed, _ = run("full", 2, ckpt_path=tmp_path / "a.ckpt", checkpoint_io=io)
    assert io.calls == [("save", str(tmp_path / "a.ckpt")), ("load", str(tmp_path / "a.ckpt"))]
    assert_same_params(full, resumed)


def test_load_checkpoint_works_as_lightning_2_4_calls_it(tmp_path):
    """Lightning 2.4/2.5 call ``strategy.load_checkpoint(path)`` and have no weights_only anywhere."""
    _, trainer = run("full", 1)
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    strategy = ZeroOffloadStrategy()
    assert torch.equal(
        strategy.load_checkpoint(tmp_path / "a.ckpt")["state_dict"]["net.0.weight"],
        trainer.lightning_module.net[0].weight,
    )


class WithPath(Classifier):
    def __init__(self, where: pathlib.Path = pathlib.Path("/data/run"), **kwargs):
        super().__init__(**kwargs)
        self.save_hyperparameters()


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_fit_weights_only_false_is_honoured(tmp_path, fmt):
    """Hyperparameters holding a pathlib.Path need weights_only=False, as with strategy="auto"."""
    _, trainer = run(fmt, 1, model=WithPath())
    trainer.save_checkpoint(tmp_path / "p.ckpt")
    with pytest.raises(CheckpointError, match=r"PosixPath.*trainer.fit\(\.\.\., weights_only=False\)"):
        run(fmt, 2, ckpt_path=tmp_path / "p.ckpt", model=WithPath())
    if "weights_only" not in inspect.signature(L.Trainer.fit).parameters:
        pytest.skip("this Lightning's fit() has no weights_only argument (added in 2.6)")
    _, resumed = run(fmt, 2, ckpt_path=tmp_path / "p.ckpt", model=WithPath(), fit_kwargs={"weights_only": False})
    assert resumed.global_step == 8


def test_a_sharded_checkpoint_fails_torch_load_as_the_docs_say_and_the_export_they_name_loads(tmp_path):
    """The README's "loads without this package" is the full format's: the docs give the error and the way."""
    model, trainer = run("sharded", 1)
    path = tmp_path / "s.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(IsADirectoryError) as error:
        torch.load(path, weights_only=True)
    with pytest.raises(IsADirectoryError):
        Classifier.load_from_checkpoint(path)
    searched = f"IsADirectoryError: [Errno {error.value.errno}] {error.value.strerror}"
    root = pathlib.Path(__file__).resolve().parent.parent
    troubleshooting = (root / "docs" / "troubleshooting.md").read_text()
    entry = troubleshooting[troubleshooting.index(searched) :].split("\n\n")[0]
    assert "zero-offload-convert" in entry and "sharded" in entry
    readme = " ".join((root / "README.md").read_text().split())
    assert "a sharded checkpoint is a directory, which those refuse with `IsADirectoryError`" in readme
    assert "`zero-offload-convert`" in readme
    from lightning_zero_offload.engine.checkpoint import main as convert

    convert([str(path), str(tmp_path / "fp32.pt")])
    fresh = Classifier()
    fresh.load_state_dict(torch.load(tmp_path / "fp32.pt", weights_only=True))
    assert_same_params(model, fresh)

"""Where the strategy's checkpoints go and how they load: fsspec paths, a user's CheckpointIO,
``fit(weights_only=False)``, Lightning versions whose loaders take no ``weights_only``, weights-only
checkpoints, and paths that are directories of another kind (both front ends)."""

import inspect
import pathlib
import re

import fsspec
import lightning as L
import pytest
import torch
from engine_helpers import batches, loss_fn, make_net
from helpers import QUIET, Classifier, loader
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO

from lightning_zero_offload import ZeroOffloadFabricStrategy, ZeroOffloadStrategy, convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.checkpoints import META_FILE, CheckpointError, current_version, shard_file
from lightning_zero_offload.warning import ZeroOffloadWarning


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
    # Lightning's own note: the resumed run has no ModelCheckpoint, whose state the checkpoint holds
    with pytest.warns(UserWarning, match="callbacks used to create the checkpoint need to be provided"):
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
    root = pathlib.Path(__file__).resolve().parents[2]
    troubleshooting = (root / "docs" / "troubleshooting.md").read_text()
    entry = troubleshooting[troubleshooting.index(searched) :].split("\n\n")[0]
    assert "zero-offload-convert" in entry and "sharded" in entry
    readme = " ".join((root / "README.md").read_text().split())
    assert "a sharded checkpoint is a directory, which those refuse with `IsADirectoryError`" in readme
    assert "`zero-offload-convert`" in readme
    from lightning_zero_offload.checkpoints.export import main as convert

    convert([str(path), str(tmp_path / "fp32.pt")])
    fresh = Classifier()
    fresh.load_state_dict(torch.load(tmp_path / "fp32.pt", weights_only=True))
    assert_same_params(model, fresh)


# -- weights-only checkpoints (ModelCheckpoint(save_weights_only=True)) ------------------------------------


# Lightning's own use of torch's deprecated pytree API warns in every Trainer run.
LIGHTNING_PYTREE = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")


def validated_run(fmt, epochs, **kwargs):
    """run() with a validation loader, which Lightning warns about lacking (Classifier has a validation_step)."""
    return run(fmt, epochs, fit_kwargs={"val_dataloaders": loader(n=16)}, **kwargs)


def fabric_setup(fmt: str):
    f = L.Fabric(accelerator="cpu", devices=1, strategy=ZeroOffloadFabricStrategy(checkpoint_format=fmt))
    f.launch()
    net = make_net()
    return f, f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))


def evaluated_under_auto(path) -> tuple[list[dict], list[torch.Tensor]]:
    """The reference: validate and predict under strategy="auto" with the weights the checkpoint holds."""
    model = Classifier(seed=1)
    model.load_state_dict(convert_checkpoint_to_fp32_state_dict(path))
    trainer = L.Trainer(**QUIET)
    return trainer.validate(model, loader(n=16), verbose=False), trainer.predict(model, loader(n=16))


@LIGHTNING_PYTREE
@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_weights_only_checkpoint_evaluates_and_refuses_to_resume_as_under_auto(tmp_path, fmt):
    """validate/test/predict(ckpt_path="best"/"last") load the weights; fit(ckpt_path=...) says why it cannot
    resume (Lightning's KeyError under auto, with the fix); the shards hold no moments."""
    # Every epoch saved, the best being the highest loss: the first epoch's, not the last; so evaluating "best"
    # shows that the weights were loaded.
    checkpoints = ModelCheckpoint(
        tmp_path, save_weights_only=True, save_last=True, monitor="val_loss", mode="max", save_top_k=-1
    )
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(checkpoint_format=fmt),
        max_epochs=3,
        callbacks=[checkpoints],
        **{**QUIET, "enable_checkpointing": True},
    )
    trainer.fit(Classifier(), loader(n=32), loader(n=16))
    best, last = checkpoints.best_model_path, checkpoints.last_model_path
    best_validated, _ = evaluated_under_auto(best)
    last_validated, last_predicted = evaluated_under_auto(last)
    assert best_validated != last_validated
    # The same weights and the same fp32 CPU forward as the reference: equal, not just close.
    assert trainer.validate(dataloaders=loader(n=16), ckpt_path="best", verbose=False) == best_validated
    tested = trainer.test(dataloaders=loader(n=16), ckpt_path="last", verbose=False)
    assert tested[0]["test_loss"] == last_validated[0]["val_loss"]
    for ours, reference in zip(trainer.predict(dataloaders=loader(n=16), ckpt_path="last"), last_predicted):
        assert torch.equal(ours, reference)
    fresh = Classifier(seed=1)  # another trainer and model: the weights come from the checkpoint
    L.Trainer(strategy=ZeroOffloadStrategy(checkpoint_format=fmt), **QUIET).validate(
        fresh, loader(n=16), ckpt_path=best
    )
    for name, weight in convert_checkpoint_to_fp32_state_dict(best).items():
        assert torch.equal(fresh.state_dict()[name], weight), name

    with pytest.raises(
        KeyError, match=r"zero_offload cannot resume trainer.fit\(ckpt_path=.*save_weights_only.*load_state_dict"
    ):
        validated_run(fmt, 4, ckpt_path=last)
    if fmt == "full":  # Lightning's own error under auto, for the same file
        with pytest.raises(KeyError, match="save_weights_only"):
            L.Trainer(max_epochs=4, **QUIET).fit(Classifier(), loader(n=32), loader(n=16), ckpt_path=last)
    else:  # the moments are not written: a third of the bytes of a full sharded save
        shard = torch.load(pathlib.Path(current_version(last).path) / shard_file(0), weights_only=True)
        assert sorted(shard) == ["master", "rank", "save_id"]


def test_a_fabric_save_of_the_model_alone_writes_no_moments_and_loads_as_plain_fabric(tmp_path):
    f, (model, optimizer) = fabric_setup("sharded")
    f.backward(loss_fn(model, batches(1)[0]))
    optimizer.step()
    f.save(tmp_path / "model.ckpt", {"model": model})
    shard = torch.load(pathlib.Path(current_version(tmp_path / "model.ckpt").path) / shard_file(0), weights_only=True)
    assert sorted(shard) == ["master", "rank", "save_id"]
    fresh = make_net(seed=1)
    f.load(tmp_path / "model.ckpt", {"model": fresh})
    for (name, loaded), trained in zip(fresh.named_parameters(), model.parameters()):
        assert torch.equal(loaded, trained), name
    # Asking for an optimizer the checkpoint does not hold: plain Fabric's error, not a KeyError of ours.
    with pytest.raises(KeyError, match="'optimizer' that does not exist in the loaded checkpoint"):
        f.load(tmp_path / "model.ckpt", {"model": model, "optimizer": optimizer})


# -- paths that are directories of another kind: the error says what the path is and what to do ------------


@LIGHTNING_PYTREE
def test_a_full_save_to_a_directory_says_what_the_directory_is(tmp_path):
    """Under auto, Lightning moves its temporary file into an empty directory under a random name."""
    _, trainer = validated_run("full", 1)
    f, (model, optimizer) = fabric_setup("full")
    empty, sharded = tmp_path / "empty", tmp_path / "sharded.ckpt"
    empty.mkdir()
    _, sharded_trainer = validated_run("sharded", 1)
    sharded_trainer.save_checkpoint(sharded)
    saved = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    messages = {
        empty: rf"to {re.escape(str(empty))}: it is an existing empty directory, not a file path\. Give the "
        rf"checkpoint a file name, such as {re.escape(str(empty / 'last.ckpt'))}, or remove the directory",
        sharded: rf"to {re.escape(str(sharded))}: it is a sharded checkpoint directory, and a file cannot replace a "
        r'directory in place. Save under another name, delete the directory first, or keep checkpoint_format="sharded"',
    }
    for path, message in messages.items():
        message = rf"zero_offload cannot save a full-format checkpoint .* {message}"
        with pytest.raises(CheckpointError, match=message):
            trainer.save_checkpoint(path)
        with pytest.raises(CheckpointError, match=message):
            f.save(path, {"model": model, "optimizer": optimizer})
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == saved  # nothing written or removed


@LIGHTNING_PYTREE
def test_a_sharded_save_to_a_directory_of_other_files_is_refused_instead_of_deleting_them(tmp_path):
    _, trainer = validated_run("sharded", 1)
    f, (model, optimizer) = fabric_setup("sharded")
    (tmp_path / "notes.txt").write_text("mine")
    message = (
        rf"zero_offload cannot save a sharded checkpoint .* to {re.escape(str(tmp_path))}: it is an existing "
        r"directory that is not a checkpoint \(it holds notes.txt\), .* "
        rf"such as {re.escape(str(tmp_path / 'last.ckpt'))}"
    )
    with pytest.raises(CheckpointError, match=message):
        trainer.save_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        f.save(tmp_path, {"model": model, "optimizer": optimizer})
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_sharded_save_replaces_its_versions_and_leaves_what_you_put_in_its_directory(tmp_path):
    """Publishing a version deleted everything else in the checkpoint's directory: an fp32 export written there
    (zero-offload-convert took the path), notes, a Hugging Face folder, silently at the next save."""
    path = tmp_path / "last.ckpt"
    _, trainer = validated_run("sharded", 1)
    trainer.save_checkpoint(path)
    first = current_version(path).name
    (path / "NOTES.txt").write_text("mine")
    (path / "hf").mkdir()
    (path / "hf" / "config.json").write_text("{}")
    trainer.save_checkpoint(path)
    assert sorted(p.name for p in path.iterdir()) == sorted(["NOTES.txt", "hf", current_version(path).name])
    assert current_version(path).name != first and (path / "hf" / "config.json").read_text() == "{}"
    assert convert_checkpoint_to_fp32_state_dict(path).keys() == trainer.lightning_module.state_dict().keys()


@LIGHTNING_PYTREE
def test_an_interrupted_sharded_save_is_named_as_such_on_load(tmp_path):
    """A kill before meta.pt is renamed into place (the last step of a save) leaves its shards and no meta.pt."""
    path = tmp_path / "last.ckpt"
    _, trainer = validated_run("sharded", 1)
    trainer.save_checkpoint(path)
    version = current_version(path).name
    (path / version / META_FILE).unlink()
    message = (
        rf"zero_offload cannot load {re.escape(str(path))}: it is a sharded checkpoint directory with no complete "
        rf"version, only what an interrupted save left \({version}: no meta.pt, which a save writes last\)\. .* "
        r"Resume from an earlier checkpoint of the run; the next save to this path deletes the incomplete version"
    )
    with pytest.raises(CheckpointError, match=message):
        validated_run("sharded", 2, ckpt_path=path)
    with pytest.raises(CheckpointError, match=message):
        L.Trainer(strategy=ZeroOffloadStrategy(checkpoint_format="sharded"), **QUIET).validate(
            Classifier(), loader(n=16), ckpt_path=path
        )
    f, (fabric_model, optimizer) = fabric_setup("sharded")
    with pytest.raises(CheckpointError, match=message):
        f.load(path, {"model": fabric_model, "optimizer": optimizer})
    with pytest.raises(CheckpointError, match=message):
        convert_checkpoint_to_fp32_state_dict(path)
    trainer.save_checkpoint(path)  # as the message says
    assert [p.name for p in path.iterdir()] == [current_version(path).name] != [version]
    _, resumed = validated_run("sharded", 2, ckpt_path=path)
    assert resumed.global_step == 8


# -- one path under both front ends: each guard and warning holds for Fabric too -------------------------------


class FabricRecordingIO(RecordingIO):
    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", str(path)))
        return torch.load(path, map_location="cpu", weights_only=weights_only is not False)


@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_a_custom_checkpoint_io_is_told_that_it_does_not_write_a_sharded_checkpoint(tmp_path, front_end):
    io = FabricRecordingIO()
    warned = pytest.warns(ZeroOffloadWarning, match='checkpoint_format="sharded" writes its shards through fsspec, not')
    if front_end == "trainer":
        _, trainer = run("sharded", 1, checkpoint_io=io)
        with warned:
            trainer.save_checkpoint(tmp_path / "s.ckpt")
    else:
        strategy = ZeroOffloadFabricStrategy(checkpoint_format="sharded", checkpoint_io=io)
        f = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        f.launch()
        net = make_net()
        model, optimizer = f.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        with warned:
            f.save(tmp_path / "s.ckpt", {"model": model, "optimizer": optimizer})
    assert io.calls == [] and current_version(tmp_path / "s.ckpt") is not None


def test_fabric_reads_a_full_checkpoint_memory_mapped_and_names_a_damaged_one(tmp_path, monkeypatch):
    from lightning_zero_offload.checkpoints import files

    f, (model, optimizer) = fabric_setup("full")
    path = tmp_path / "f.ckpt"
    f.save(path, {"model": model, "optimizer": optimizer})
    loads = []
    torch_load = files.torch.load
    monkeypatch.setattr(
        files.torch, "load", lambda *args, **kwargs: loads.append(kwargs) or torch_load(*args, **kwargs)
    )
    f.load(path, {"model": model, "optimizer": optimizer})
    assert [(kwargs["mmap"], kwargs["weights_only"]) for kwargs in loads] == [(True, True)]
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(path))} is truncated or corrupt"):
        f.load(path, {"model": model, "optimizer": optimizer})


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_fabric_loads_python_objects_only_with_weights_only_false(tmp_path, fmt):
    f, (model, optimizer) = fabric_setup(fmt)
    path = tmp_path / "p.ckpt"
    f.save(path, {"model": model, "optimizer": optimizer, "where": pathlib.Path("/data/run")})
    with pytest.raises(CheckpointError, match="refused by weights_only loading: it holds Python objects"):
        f.load(path, {"model": model, "optimizer": optimizer})
    state = {"model": model, "optimizer": optimizer, "where": None}
    assert f.load(path, state, weights_only=False) == {} and state["where"] == pathlib.Path("/data/run")

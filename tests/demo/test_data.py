"""The embedded corpus: the Python standard library's sources as byte-level LM data."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload.demo.data import (
    ChunkDataset,
    EpochShuffle,
    RandomWindowDataset,
    ResumableLoader,
    StdlibCorpusDataModule,
    is_val_file,
    list_source_files,
    stdlib_dir,
)

# Small enough to build in well under a second, large enough for both splits to hold many windows.
SMALL = {"block_size": 64, "batch_size": 4, "max_bytes": 1_000_000, "val_fraction": 0.2, "val_samples": 32}


@pytest.fixture(scope="module")
def dm() -> StdlibCorpusDataModule:
    module = StdlibCorpusDataModule(**SMALL)
    module.setup("fit")
    return module


def test_source_listing_is_sorted_and_skips_tests_and_site_packages():
    files = list_source_files(stdlib_dir())
    assert files, "the interpreter's stdlib should have .py files"
    assert files == sorted(files)
    for rel in files:
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts[:-1]), rel


def test_corpus_is_non_empty_bytes_and_capped(dm):
    assert dm.train_data.dtype == torch.uint8 and dm.val_data.dtype == torch.uint8
    assert dm.train_data.numel() > 100_000
    assert dm.val_data.numel() > SMALL["block_size"] + 1
    assert dm.train_data.numel() + dm.val_data.numel() <= SMALL["max_bytes"]
    # uint8 already bounds values to [0, 255]; check they are real text bytes, not all zeros.
    assert int(dm.train_data.max()) < 256 and int(dm.train_data.max()) > 0
    assert (dm.train_data == ord("\n")).any()


def test_corpus_is_deterministic(dm):
    other = StdlibCorpusDataModule(**SMALL)
    other.setup("fit")
    assert other.train_files == dm.train_files and other.val_files == dm.val_files
    assert torch.equal(other.train_data, dm.train_data)
    assert torch.equal(other.val_data, dm.val_data)
    assert torch.equal(other.train_dataset.offsets, dm.train_dataset.offsets)
    assert torch.equal(other.val_dataset.offsets, dm.val_dataset.offsets)
    # The training windows depend on the seed, the corpus does not.
    reseeded = StdlibCorpusDataModule(**{**SMALL, "seed": 7})
    reseeded.setup("fit")
    assert torch.equal(reseeded.train_data, dm.train_data)
    assert not torch.equal(reseeded.train_dataset.offsets, dm.train_dataset.offsets)


def test_train_and_val_are_disjoint_by_file(dm):
    assert dm.train_files and dm.val_files
    assert not set(dm.train_files) & set(dm.val_files)
    assert all(is_val_file(f, SMALL["val_fraction"]) for f in dm.val_files)
    assert not any(is_val_file(f, SMALL["val_fraction"]) for f in dm.train_files)
    # Together they are a prefix of the sorted listing (the byte cap stops the walk).
    listed = list_source_files(stdlib_dir())
    used = sorted(dm.train_files + dm.val_files)
    assert used == listed[: len(used)]


def test_windows_are_shifted_by_one(dm):
    block = SMALL["block_size"]
    for ds, data in ((dm.train_dataset, dm.train_data), (dm.val_dataset, dm.val_data)):
        for i in (0, len(ds) // 2, len(ds) - 1):
            x, y = ds[i]
            assert x.shape == (block,) and y.shape == (block,)
            assert x.dtype == torch.long and y.dtype == torch.long
            assert torch.equal(x[1:], y[:-1])
            start = int(ds.offsets[i])
            assert torch.equal(y, data[start + 1 : start + block + 1].long())
    # One random window per block_size bytes of training text by default.
    assert len(dm.train_dataset) == dm.train_data.numel() // block
    n_chunks = (dm.val_data.numel() - 1) // block
    assert len(dm.val_dataset) == min(SMALL["val_samples"], n_chunks)


def test_val_chunks_do_not_overlap_and_span_the_text(dm):
    offsets = dm.val_dataset.offsets
    block = SMALL["block_size"]
    assert (offsets.diff() >= block).all()
    assert int(offsets[0]) == 0
    assert int(offsets[-1]) + block + 1 > dm.val_data.numel() - 2 * block


def test_dataloaders(dm):
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (SMALL["batch_size"], SMALL["block_size"])
    batches = list(dm.val_dataloader())
    assert sum(b[0].shape[0] for b in batches) == len(dm.val_dataset)


def test_samples_per_epoch_option():
    module = StdlibCorpusDataModule(**{**SMALL, "samples_per_epoch": 10})
    module.setup("fit")
    assert len(module.train_dataset) == 10


def test_unigram_perplexity(dm):
    ppl = dm.unigram_perplexity()
    assert math.isfinite(ppl)
    assert 1.0 < ppl < 256.0
    # Source code is far from uniform over bytes (mostly ASCII letters, spaces and newlines).
    assert ppl < 64.0
    # It is the exp of the cross-entropy of the smoothed train frequencies on the val targets.
    counts = torch.bincount(dm.train_data.long(), minlength=256).double() + 1
    probs = counts / counts.sum()
    targets = torch.cat([dm.val_dataset[i][1] for i in range(len(dm.val_dataset))])
    expected = math.exp(-probs[targets].log().mean().item())
    assert ppl == pytest.approx(expected, rel=1e-9)


def test_empty_root_gives_clear_error(tmp_path):
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "x.py").write_text("print('not stdlib')\n")
    module = StdlibCorpusDataModule(root=str(tmp_path), block_size=8, max_bytes=1000)
    with pytest.raises(FileNotFoundError, match=r"No \*\.py files"):
        module.setup("fit")


def test_custom_root_and_tiny_split(tmp_path):
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(f"# {name}\n" + "x = 1\n" * 200)
    module = StdlibCorpusDataModule(root=str(tmp_path), block_size=16, max_bytes=100_000, val_fraction=0.01)
    module.setup("fit")
    # Both splits exist even when the hash puts no file in validation.
    assert module.train_files and module.val_files
    assert sorted(module.train_files + module.val_files) == ["a.py", "b.py", "c.py"]


def test_datasets_reject_too_short_text():
    with pytest.raises(ValueError):
        RandomWindowDataset(torch.zeros(4, dtype=torch.uint8), block_size=8, num_samples=2, seed=0)
    with pytest.raises(ValueError):
        ChunkDataset(torch.zeros(4, dtype=torch.uint8), block_size=8)


def test_epoch_shuffle_depends_on_the_seed_and_epoch_only():
    data = list(range(50))
    a, b = EpochShuffle(data, seed=3), EpochShuffle(data, seed=3)
    torch.manual_seed(0)
    first = list(a)
    torch.manual_seed(1)  # the global generator plays no part
    assert list(b) == first and sorted(first) == data
    a.set_epoch(1)
    second = list(a)
    assert second != first
    b.set_epoch(1)
    assert list(b) == second
    a.set_epoch(0)
    assert list(a) == first
    assert list(EpochShuffle(data, seed=4)) != first


def train_demo(tmp_path, max_steps, ckpt_path=None, every=None):
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_zero_offload.demo import GPT

    L.seed_everything(7)
    model = GPT(block_size=32, n_layer=1, n_head=2, n_embd=32, lr=1e-2, warmup_steps=2)
    data = StdlibCorpusDataModule(block_size=32, batch_size=4, max_bytes=200_000, samples_per_epoch=40, val_samples=8)
    callbacks = [ModelCheckpoint(tmp_path, every_n_train_steps=every, save_top_k=-1)] if every else []
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(cpu_state="bf16"),
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=bool(every),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data, ckpt_path=ckpt_path)
    assert not [w for w in caught if "not resumable" in str(w.message)]
    return model


@pytest.mark.parametrize(
    "stop", [4, pytest.param(10, marks=pytest.mark.slow)], ids=["mid-epoch", "epoch-end"]
)  # 10 batches per epoch
def test_the_demo_resumed_from_a_checkpoint_trains_the_uninterrupted_run_bitwise(tmp_path, stop):
    # 14 steps: past the first epoch's end, so both the resumed position and the next epoch's order count.
    # The run that writes the checkpoint is the uninterrupted one (the lr schedule follows max_steps).
    straight = train_demo(tmp_path / "straight", 14, every=stop)
    (ckpt,) = (tmp_path / "straight").glob(f"*step={stop}.ckpt")
    assert torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    resumed = train_demo(tmp_path / "resumed", 14, ckpt_path=ckpt)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_the_loader_state_gives_the_saved_seed_and_skips_the_batches_given_out():
    dataset = list(range(40))
    saved = ResumableLoader(dataset, batch_size=4, sampler=EpochShuffle(dataset, seed=11), drop_last=True)
    batches = iter(saved)
    first = [next(batches).tolist() for _ in range(3)]
    state = saved.state_dict()
    assert state == {"batches_given": 3, "shuffle_seed": 11}
    rest = [b.tolist() for b in batches]
    resumed = ResumableLoader(dataset, batch_size=4, sampler=EpochShuffle(dataset, seed=99), drop_last=True)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest  # the saved seed's order, from the fourth batch
    next_epoch = [i for b in resumed for i in b.tolist()]
    assert sorted(next_epoch) == dataset  # the next epoch is whole again, with nothing skipped
    assert next_epoch[:12] != [i for b in first for i in b]  # and (no set_epoch) in another order

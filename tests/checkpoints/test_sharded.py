"""The sharded format (checkpoints/sharded.py): every file checked and named when damaged, failed saves
cleaned up, versions and world sizes read back, weights-only checkpoints at one and two ranks."""

import functools
import os
import shutil
import struct
import zlib

import lightning as L
import pytest
import torch
from checkpoint_helpers import load_w, save_sharded_one_rank
from helpers import QUIET, Classifier, loader
from workers.checkpoints import in_version, save_weights_only_at_rank

from lightning_zero_offload import ZeroOffloadStrategy
from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload.checkpoints import FORMAT_KEY, META_FILE, CheckpointError
from lightning_zero_offload.checkpoints import files as checkpoint_files
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded


def test_a_rank_that_fails_to_write_its_shard_fails_the_save_on_every_rank(tmp_path):
    """Every rank sees every rank's outcome (no rank waits for a failed one), and nothing is published."""
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    shard = {name: torch.zeros(5) for name in checkpoint_sharded.SHARD_KEYS}
    meta = torch.load(in_version(root, META_FILE), weights_only=True)
    rank1_failed = checkpoint_sharded._Failure("OSError: [Errno 28] No space left on device")
    with pytest.raises(CheckpointError, match=r"failed on rank 1: OSError: \[Errno 28\] No space left"):
        ckpt.save_sharded(root, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x, rank1_failed])
    assert torch.equal(load_w(root), torch.ones(5))


def test_a_truncated_shard_or_metadata_is_named(tmp_path):
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    shard = in_version(root, ckpt.shard_file(0))
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard} has \d+ bytes, the metadata says \d+: truncated"):
        ckpt.load_sharded(root)

    save_sharded_one_rank(root, 1.0)
    meta = in_version(root, META_FILE)
    meta.write_bytes(meta.read_bytes()[: meta.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"metadata {meta} is truncated or corrupt"):
        ckpt.load_sharded(root)


def rewrite_meta(root, edit) -> None:
    meta_file = in_version(root, META_FILE)
    meta = torch.load(meta_file, weights_only=True)
    edit(meta[FORMAT_KEY])
    torch.save(meta, meta_file)


def test_edited_metadata_is_named_not_an_index_error(tmp_path):
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    rewrite_meta(root, lambda info: info["params"][0].update(offset=3))
    with pytest.raises(CheckpointError, match=r"meta.pt was modified after it was saved"):
        ckpt.load_sharded(root)

    def edit_and_recompute(info):  # a consistent-looking edit still cannot index out of the shards
        info["params"][0].update(bucket=4)
        info["layout_crc32"] = checkpoint_sharded.layout_checksum(info)

    save_sharded_one_rank(root, 1.0)
    rewrite_meta(root, edit_and_recompute)
    with pytest.raises(CheckpointError, match=r"meta.pt does not match its shards \(IndexError"):
        ckpt.load_sharded(root)


def test_a_shard_missing_exp_avg_or_edited_is_named_not_a_key_error(tmp_path):
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    shard = in_version(root, ckpt.shard_file(0))
    state = torch.load(shard, weights_only=True)
    state.pop("exp_avg")
    record = checkpoint_files.save_file(state, checkpoint_files.Location(str(shard)))

    def accept_the_new_shard(info):
        info["shards"][0] = {"size": record.size, "crc32": record.crc32}
        info["layout_crc32"] = checkpoint_sharded.layout_checksum(info)

    rewrite_meta(root, accept_the_new_shard)
    with pytest.raises(CheckpointError, match=rf"{shard} has no valid 'exp_avg' tensor"):
        ckpt.load_sharded(root)
    assert torch.equal(ckpt.load_sharded(root, with_optimizer=False)["state_dict"]["w"], torch.ones(5))

    save_sharded_one_rank(root, 1.0)
    shard = in_version(root, ckpt.shard_file(0))
    data = bytearray(shard.read_bytes())
    position = data.rindex(torch.ones(1).numpy().tobytes())  # a float 1.0 of the master weights
    data[position : position + 4] = torch.full((1,), 1.5).numpy().tobytes()
    shard.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{shard} does not match its checksum in the metadata"):
        ckpt.load_sharded(root)


def test_a_shard_from_another_save_of_the_same_model_is_refused(tmp_path):
    ours, theirs = tmp_path / "ours.ckpt", tmp_path / "theirs.ckpt"
    save_sharded_one_rank(ours, 1.0)
    save_sharded_one_rank(theirs, 2.0)
    shutil.copyfile(in_version(theirs, ckpt.shard_file(0)), in_version(ours, ckpt.shard_file(0)))
    with pytest.raises(
        CheckpointError, match=rf"{in_version(ours, ckpt.shard_file(0))} belongs to another save than its metadata"
    ):
        ckpt.load_sharded(ours)


def test_checksum_is_of_the_bytes_as_written(tmp_path):
    path = tmp_path / "x.pt"
    record = checkpoint_files.save_file({"w": torch.randn(1000)}, checkpoint_files.Location(str(path)))
    assert record.size == path.stat().st_size and record.crc32 == zlib.crc32(path.read_bytes())


def test_a_version_1_sharded_directory_still_loads(tmp_path):
    """Checkpoints written before versioned directories: meta.pt and shards directly in the directory."""
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    version = checkpoint_sharded.current_version(root).path
    for name in os.listdir(version):
        os.replace(os.path.join(version, name), root / name)
    os.rmdir(version)
    rewrite_meta(root, lambda info: [info.pop(k) for k in ("shards", "save_id", "layout_crc32")])
    assert torch.equal(ckpt.load_sharded(root)["state_dict"]["w"], torch.ones(5))
    save_sharded_one_rank(root, 2.0)  # the next save replaces the old layout
    assert [p.name for p in root.iterdir()] == ["v000001"] and torch.equal(load_w(root), torch.full((5,), 2.0))


def test_a_sharded_save_without_optimizer_state_writes_and_reads_the_weights_only(tmp_path):
    """ModelCheckpoint(save_weights_only=True) leaves optimizer_states out of the checkpoint: the shards then
    hold the master weights alone (the moments would be 2/3 of their bytes), and the load returns no
    optimizer state, as a full-format file saved so, rather than a KeyError."""
    full, weights_only = tmp_path / "full.ckpt", tmp_path / "weights.ckpt"
    save_sharded_one_rank(full, 1.0)
    meta = torch.load(in_version(full, META_FILE), weights_only=True)
    meta.pop("optimizer_states")
    flat = torch.ones(5)
    shard = {name: flat for name in checkpoint_sharded.SHARD_KEYS}
    ckpt.save_sharded(weights_only, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x])
    written = torch.load(in_version(weights_only, ckpt.shard_file(0)), weights_only=True)
    assert sorted(written) == ["master", "rank", "save_id"]
    loaded = ckpt.load_sharded(weights_only)
    assert "optimizer_states" not in loaded and torch.equal(loaded["state_dict"]["w"], torch.ones(5))
    assert "optimizer_states" in ckpt.load_sharded(full)


@pytest.mark.slow  # two ranks in processes
def test_at_two_ranks_no_rank_writes_moments_for_a_checkpoint_without_optimizer_state(tmp_path):
    from lightning_zero_offload.testing.ranks import run_ranks

    path = tmp_path / "weights.ckpt"
    entries = run_ranks(functools.partial(save_weights_only_at_rank, str(path)), 2, tmp_path)
    assert entries == [["master", "rank", "save_id"]] * 2
    loaded = ckpt.load_sharded(path)
    assert "optimizer_states" not in loaded and torch.equal(loaded["state_dict"]["w"], torch.arange(5.0))


def test_sharded_shard_math_matches_full_tensors(tmp_path):
    """Shard files reassembled by name give the full parameters and torch-format optimizer state."""
    trainer = L.Trainer(
        strategy=ZeroOffloadStrategy(checkpoint_format="sharded", bucket_size_mb=0.001), max_steps=2, **QUIET
    )
    model = Classifier(width=7)
    trainer.fit(model, loader())
    trainer.save_checkpoint(tmp_path / "s.ckpt")
    loaded = ckpt.load_sharded(tmp_path / "s.ckpt")
    for name, p in model.named_parameters():
        assert torch.equal(loaded["state_dict"][name], p.detach())
    state = loaded["optimizer_states"][0]["state"]
    assert float(state[0]["step"]) == 2 and state[0]["exp_avg"].shape == next(model.parameters()).shape


def fit_with_buckets(bucket_size_mb, tmp_path, max_steps=6, ckpt_path=None, save=None):
    """The offload data path, speculative with clipping that fires."""
    model = Classifier(width=64)
    strategy = ZeroOffloadStrategy(
        checkpoint_format="sharded", bucket_size_mb=bucket_size_mb, in_place_on_cpu=False, cpu_step="speculative"
    )
    trainer = L.Trainer(
        strategy=strategy, max_steps=max_steps, default_root_dir=tmp_path, gradient_clip_val=0.3, **QUIET
    )
    trainer.fit(model, loader(24), ckpt_path=ckpt_path)  # 3 steps an epoch: resumes at its end
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer


def test_a_split_parameter_resumes_into_buckets_that_hold_it_whole_and_back(tmp_path):
    """Saved with buckets smaller than the 64 x 64 weight (its metadata places it from one bucket into the next
    ones), resumed with buckets that hold it whole, and the reverse: as resumed into the layout it was saved from."""
    split, whole = 0.004, 1.0  # 1048 fp32 elements; a megabyte
    resumed = {}
    for saved, loaded in ((split, split), (split, whole), (whole, split)):
        path = tmp_path / f"{saved}-{loaded}.ckpt"
        _, trainer = fit_with_buckets(saved, tmp_path, max_steps=3, save=path)
        spans = any(s.last_bucket > s.bucket for s in trainer.strategy.session.engine.layout.slots)
        info = torch.load(in_version(path, META_FILE), weights_only=True)[FORMAT_KEY]
        chunk = info["buckets"][0]["shard_numel"]
        assert spans == any(torch.Size(p["shape"]).numel() > chunk for p in info["params"]) == (saved == split)
        resumed[saved, loaded], _ = fit_with_buckets(loaded, tmp_path, ckpt_path=path)
    want = resumed[split, split]
    for got in (resumed[split, whole], resumed[whole, split]):
        assert all(torch.equal(got[k], v) for k, v in want.items())


def save_sharded_with_module_state(path) -> dict:
    """A sharded checkpoint whose meta.pt holds what the issue saw damaged: a BatchNorm buffer and a
    param group's weight_decay (numbers inside the pickle and inside a tensor record)."""
    meta = {
        "state_dict": {"bn.running_mean": torch.arange(4.0)},
        "optimizer_states": [{"state": {}, "param_groups": [{"weight_decay": 0.01, "params": [0]}]}],
        FORMAT_KEY: {
            "format": "sharded",
            "version": 2,
            "world_size": 1,
            "buckets": [{"shard_start": 0, "shard_numel": 5}],
            "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
        },
    }
    shard = {name: torch.ones(5) for name in checkpoint_sharded.SHARD_KEYS}
    ckpt.save_sharded(path, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x])
    return ckpt.load_sharded(path)


@pytest.mark.slow  # loads the file once per byte
def test_a_flipped_byte_anywhere_in_meta_pt_is_refused_naming_it_or_harmless(tmp_path):
    """The issue's two silent corruptions (a BatchNorm running_mean, a weight_decay), then every byte."""
    root = tmp_path / "s.ckpt"
    good = save_sharded_with_module_state(root)
    meta = in_version(root, META_FILE)
    data = meta.read_bytes()
    targets = {
        "running_mean": data.index(torch.arange(4.0).numpy().tobytes()) + 1,
        "weight_decay": data.index(struct.pack(">d", 0.01)) + 7,  # pickle's BINFLOAT is big-endian
    }
    for what, position in targets.items():
        flipped = bytearray(data)
        flipped[position] ^= 0x40
        meta.write_bytes(flipped)
        with pytest.raises(CheckpointError) as error:
            ckpt.load_sharded(root)
        assert f"metadata {meta} is corrupt or was edited: its record" in str(error.value), what
    refused = 0
    for position in range(len(data)):
        flipped = bytearray(data)
        flipped[position] ^= 0x01
        meta.write_bytes(flipped)
        try:
            loaded = ckpt.load_sharded(root)
        except CheckpointError as error:
            assert str(meta) in str(error)
            refused += 1
            continue
        # what loads despite the flip is bytes nothing reads (zip padding, timestamps): the same checkpoint
        assert repr(loaded) == repr(good), position
    assert refused > len(data) // 2


def test_a_failed_sharded_save_removes_its_partial_version_and_the_previous_checkpoint_loads(tmp_path, monkeypatch):
    root = tmp_path / "s.ckpt"
    save_sharded_one_rank(root, 1.0)
    previous = sorted(p.name for p in root.iterdir())
    real_save_file = checkpoint_sharded.save_file

    def fail_midway(obj, target, exclusive=False, streamed=None):
        if target.name == failing[0]:
            if exclusive:  # a shard is written in place: half of it is there (meta.pt goes through a temporary)
                with open(target.path, "wb") as f:
                    f.write(b"PK half a file")
            raise OSError(28, "No space left on device")
        return real_save_file(obj, target, exclusive, streamed)

    monkeypatch.setattr(checkpoint_sharded, "save_file", fail_midway)
    for failing in ([ckpt.shard_file(0)], [META_FILE]):
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_sharded_one_rank(root, 2.0)
        assert sorted(p.name for p in root.iterdir()) == previous, failing  # no partial version left
        assert torch.equal(load_w(root), torch.ones(5))
    monkeypatch.undo()
    save_sharded_one_rank(root, 3.0)
    assert torch.equal(load_w(root), torch.full((5,), 3.0)) and len(list(root.iterdir())) == 1

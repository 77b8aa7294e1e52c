"""Checkpoint files: crash safety at every step of a save, safe temporaries, corruption named on load,
the sharded format read back at another world size, and the export tool's safety checks."""

import functools
import os
import random
import shutil
import struct
import zlib
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import QUIET, Classifier, loader

from lightning_zero_offload import ZeroOffloadStrategy, convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload.checkpoints import FORMAT_KEY, META_FILE, CheckpointError, export
from lightning_zero_offload.checkpoints import files as checkpoint_files
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded
from lightning_zero_offload.checkpoints import writer as checkpoint_writer


def full_checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((5,), value)}, "optimizer_states": [{"state": {}, "param_groups": []}]}


def save_sharded_one_rank(path, value: float, world: int = 1) -> None:
    """A world-size-``world`` sharded checkpoint of one parameter ``w`` (5 values) in one bucket, saved from
    this process as every rank in turn would (only rank 0's collectives matter with trivial ones)."""
    chunk = -(-5 // world)
    flat = torch.cat([torch.full((5,), value), torch.zeros(chunk * world - 5)])
    meta = full_checkpoint(value)
    meta.pop("state_dict")
    meta[FORMAT_KEY] = {
        "format": "sharded",
        "version": 2,
        "world_size": world,
        "buckets": [{"shard_start": 0, "shard_numel": chunk}],
        "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
    }
    assert world == 1, "one process plays rank 0 only"
    shard = {name: flat.clone() for name in checkpoint_sharded.SHARD_KEYS}
    ckpt.save_sharded(path, shard, meta, 0, broadcast=lambda x: x, gather=lambda x: [x])


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


def save(fmt: str, path, value: float) -> None:
    if fmt == "full":
        ckpt.atomic_save(full_checkpoint(value), path)
    else:
        save_sharded_one_rank(path, value)


def load_w(path) -> torch.Tensor:
    return convert_checkpoint_to_fp32_state_dict(path)["w"]


# Every call that changes the filesystem during a save; a crash is injected before or after each of them.
MUTATIONS = ("replace", "rename", "unlink", "rmdir", "mkdir", "open")


def crash_at(step: int, after: bool, fmt: str, path) -> bool:
    """Save in a forked child that dies (os._exit: no cleanup, like kill -9) at mutation ``step``.

    Returns whether the child reached that step (``False``: the save finished with fewer mutations).
    """
    pid = os.fork()
    if pid == 0:  # the child
        counter = [0]

        def wrap(name):
            real = getattr(os, name)

            def mutation(*args, **kwargs):
                if name == "open" and not (args[1] if len(args) > 1 else kwargs["flags"]) & os.O_CREAT:
                    return real(*args, **kwargs)  # reading is not a step
                counter[0] += 1
                if counter[0] == step and not after:
                    os._exit(9)
                try:
                    return real(*args, **kwargs)
                finally:
                    if counter[0] == step:
                        os._exit(9)

            return mutation

        for name in MUTATIONS:
            setattr(os, name, wrap(name))
        save(fmt, path, 2.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 9


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_kill_at_any_step_of_a_save_leaves_a_checkpoint_and_the_next_save_cleans_up(tmp_path, fmt):
    path = tmp_path / "last.ckpt"
    crashes = 0
    for step in range(1, 100):
        for after in (False, True):
            save(fmt, path, 1.0)
            if not crash_at(step, after, fmt, path):
                assert step > 1, "the injection never fired"
                assert crashes >= {"full": 4, "sharded": 12}[fmt], f"only {crashes} crash points in a {fmt} save"
                return
            crashes += 1
            w = load_w(path)  # complete: the previous checkpoint or, once it is published, the new one
            assert torch.equal(w, torch.ones(5)) or torch.equal(w, torch.full((5,), 2.0)), (step, after, w)
            save(fmt, path, 3.0)  # the next save works and removes what the crash left
            assert torch.equal(load_w(path), torch.full((5,), 3.0))
            assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], (step, after)
            if fmt == "sharded":
                assert [p.name for p in path.iterdir()] == [checkpoint_sharded.current_version(path).name]
    pytest.fail("the save never completed")


def test_atomic_save_never_leaves_a_half_written_file(tmp_path, monkeypatch):
    path = tmp_path / "model.ckpt"
    ckpt.atomic_save({"w": torch.ones(3)}, path)

    def crash(obj, f):
        f.write(b"partial bytes")
        raise KeyboardInterrupt  # interrupted mid-write

    monkeypatch.setattr(checkpoint_writer.torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.atomic_save({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.ckpt"]  # no temporary left behind


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_temporary_files_never_follow_a_planted_symlink(tmp_path, fmt):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    path = tmp_path / "run" / "last.ckpt"
    save(fmt, path, 1.0)
    # every name a save could be predicted to use: the old ".name.tmp-PID" scheme, the next version
    # directory and the files inside it
    links = [path.parent / f".last.ckpt.tmp-{os.getpid()}", path.parent / ".last.ckpt.incomplete"]
    if fmt == "sharded":
        links += [path / "v000002", path / "v000003" / "x"]
        (path / "v000003").symlink_to(victim, target_is_directory=True)
    for link in links[:3]:
        link.symlink_to(victim / "precious")
    save(fmt, path, 2.0)
    assert (victim / "precious").read_text() == "keep me" and sorted(os.listdir(victim)) == ["precious"]
    assert torch.equal(load_w(path), torch.full((5,), 2.0))
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]  # the planted links are gone
    if fmt == "sharded":
        assert [p.name for p in path.iterdir()] == ["v000004"]


# -- corruption is detected and named -------------------------------------------------------------


def test_a_truncated_or_foreign_full_checkpoint_is_named(tmp_path):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_save(full_checkpoint(1.0), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{path} is truncated or corrupt"):
        ckpt.load_checkpoint_file(path)
    for seed in range(200):  # random bytes fail inside the legacy unpickler in many different ways
        path.write_bytes(random.Random(seed).randbytes(4096))
        with pytest.raises(CheckpointError, match=rf"{path} is not a PyTorch checkpoint") as error:
            ckpt.load_checkpoint_file(path)
        assert "weights_only" not in str(error.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        ckpt.load_checkpoint_file(tmp_path / "missing.ckpt")


def in_version(root, name: str) -> Path:
    return Path(checkpoint_sharded.current_version(root).path) / name


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


def save_weights_only_at_rank(path: str, rank: int) -> list[str]:
    """Rank ``rank`` of two saves ``w`` = 0..4 (3 values on rank 0, 2 and padding on rank 1) in a checkpoint
    without optimizer state (only rank 0 holds it: the others learn it from rank 0); its shard's entries."""
    import torch.distributed as dist

    def broadcast(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(obj):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    meta = None
    if rank == 0:
        meta = {
            "state_dict": {},
            FORMAT_KEY: {
                "format": "sharded",
                "version": 2,
                "world_size": 2,
                "buckets": [{"shard_start": 0, "shard_numel": 3}],
                "params": [{"keys": ["w"], "shape": [5], "bucket": 0, "offset": 0, "step": 1, "torch_index": 0}],
            },
        }
    flat = torch.arange(6.0)[3 * rank : 3 * rank + 3]
    ckpt.save_sharded(path, {name: flat for name in checkpoint_sharded.SHARD_KEYS}, meta, rank, broadcast, gather)
    return sorted(torch.load(in_version(path, ckpt.shard_file(rank)), weights_only=True))


@pytest.mark.slow  # two ranks in processes
def test_at_two_ranks_no_rank_writes_moments_for_a_checkpoint_without_optimizer_state(tmp_path):
    from lightning_zero_offload.testing.ranks import run_ranks

    path = tmp_path / "weights.ckpt"
    entries = run_ranks(functools.partial(save_weights_only_at_rank, str(path)), 2, tmp_path)
    assert entries == [["master", "rank", "save_id"]] * 2
    loaded = ckpt.load_sharded(path)
    assert "optimizer_states" not in loaded and torch.equal(loaded["state_dict"]["w"], torch.arange(5.0))


# -- Lightning round trip ------------------------------------------------------------------------


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


# -- zero-offload-convert ---------------------------------------------------------------------------


def convert(capsys, *argv) -> tuple[int, str]:
    try:
        export.main([str(a) for a in argv])
        code = 0
    except SystemExit as done:
        code = done.code
    captured = capsys.readouterr()
    return code, captured.err


def test_convert_refuses_to_overwrite_its_input_or_a_training_checkpoint(tmp_path, capsys, monkeypatch):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_save(full_checkpoint(1.0), path)
    before = path.read_bytes()
    (tmp_path / "alias.ckpt").symlink_to(path)
    monkeypatch.chdir(tmp_path)
    for output in (path, tmp_path / "alias.ckpt", "last.ckpt", tmp_path / "sub" / ".." / "last.ckpt"):
        code, err = convert(capsys, path, output)
        assert code != 0 and "refusing to write" in err and "the checkpoint itself" in err, output
    other = tmp_path / "other.ckpt"
    ckpt.atomic_save(full_checkpoint(2.0), other)
    code, err = convert(capsys, path, other)
    assert code != 0 and "is a training checkpoint" in err
    assert path.read_bytes() == before and torch.equal(
        torch.load(other, weights_only=True)["state_dict"]["w"], 2 * torch.ones(5)
    )
    assert convert(capsys, path, other, "--overwrite")[0] == 0
    assert torch.equal(torch.load(other, weights_only=True)["w"], torch.ones(5))
    sharded = tmp_path / "s.ckpt"
    save_sharded_one_rank(sharded, 1.0)
    assert "is a directory" in convert(capsys, path, sharded)[1]
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    assert "is not an fp32 state dict" in convert(capsys, path, notes)[1] and notes.read_text() == "mine"
    assert convert(capsys, path, other)[0] == 0  # an earlier export is replaced without asking


def test_convert_gives_one_line_errors_for_bad_inputs(tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    not_lightning = tmp_path / "tensor.pt"
    torch.save(torch.ones(2), not_lightning)
    cases = {
        tmp_path / "missing.ckpt": "does not exist",
        junk: "is not a PyTorch checkpoint",
        tmp_path: "is a directory, not a checkpoint file",
        not_lightning: "not a checkpoint dict",
    }
    for source, message in cases.items():
        code, err = convert(capsys, source, tmp_path / "out.pt")
        assert code == 1 and message in err and str(source) in err, (source, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


# -- every file of a sharded checkpoint is checked; failed saves clean up; refusals are named ----------


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

    def fail_midway(obj, target, exclusive=False):
        if target.name == failing[0]:
            if exclusive:  # a shard is written in place: half of it is there (meta.pt goes through a temporary)
                with open(target.path, "wb") as f:
                    f.write(b"PK half a file")
            raise OSError(28, "No space left on device")
        return real_save_file(obj, target, exclusive)

    monkeypatch.setattr(checkpoint_sharded, "save_file", fail_midway)
    for failing in ([ckpt.shard_file(0)], [META_FILE]):
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_sharded_one_rank(root, 2.0)
        assert sorted(p.name for p in root.iterdir()) == previous, failing  # no partial version left
        assert torch.equal(load_w(root), torch.ones(5))
    monkeypatch.undo()
    save_sharded_one_rank(root, 3.0)
    assert torch.equal(load_w(root), torch.full((5,), 3.0)) and len(list(root.iterdir())) == 1


class _RunsCode:
    def __reduce__(self):
        return os.system, ("true",)


class _CustomClass:
    pass


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_checkpoint_carrying_code_is_named_as_refused_not_as_corrupt(tmp_path, fmt):
    for payload, name in ((_RunsCode(), f"{os.system.__module__}.system"), (_CustomClass(), "_CustomClass")):
        path = tmp_path / f"{fmt}.ckpt"
        if fmt == "full":
            torch.save({"state_dict": {}, "payload": payload}, path)
            target, load = path, ckpt.load_checkpoint_file
        else:
            save_sharded_one_rank(path, 1.0)
            target = in_version(path, META_FILE)
            torch.save({"payload": payload, **torch.load(target, weights_only=True)}, target)
            load = ckpt.load_sharded
        with pytest.raises(CheckpointError) as error:
            load(path)
        message = str(error.value)
        assert f"{target} was refused by weights_only loading" in message and name in message, message
        assert "only files you trust with weights_only=False" in message and "re-save" in message
        assert "truncated or corrupt" not in message


def test_files_get_the_mode_torch_save_gives_them(tmp_path):
    """0o666 less the umask, like torch.save and the shards, not mkstemp's owner-only 0o600."""
    previous = os.umask(0o022)
    try:
        for umask in (0o022, 0o002):
            os.umask(umask)
            where = tmp_path / f"umask{umask:o}"
            where.mkdir()
            torch.save({}, where / "plain.pt")
            expected = (where / "plain.pt").stat().st_mode & 0o777
            assert expected == 0o666 & ~umask
            ckpt.atomic_save(full_checkpoint(1.0), where / "full.ckpt")
            save_sharded_one_rank(where / "s.ckpt", 1.0)
            convert_checkpoint_to_fp32_state_dict(where / "full.ckpt", where / "export.pt")
            written = [where / "full.ckpt", where / "export.pt", *Path(where / "s.ckpt").rglob("*.pt")]
            assert len(written) == 4
            for path in written:
                assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode))
    finally:
        os.umask(previous)


def test_the_python_export_refuses_what_the_cli_refuses_with_the_same_message(tmp_path, capsys):
    path = tmp_path / "last.ckpt"
    ckpt.atomic_save(full_checkpoint(1.0), path)
    before = path.read_bytes()
    other = tmp_path / "other.ckpt"
    ckpt.atomic_save(full_checkpoint(2.0), other)
    sharded = tmp_path / "s.ckpt"
    save_sharded_one_rank(sharded, 1.0)
    for output in (path, other, sharded):
        with pytest.raises(CheckpointError, match=rf"refusing to write {output}: ") as error:
            convert_checkpoint_to_fp32_state_dict(path, output)
        code, err = convert(capsys, path, output)
        assert code != 0
        cli_message = err.removeprefix("zero-offload-convert: error: ").strip()
        assert cli_message == str(error.value).replace("overwrite=True", "--overwrite"), output
    assert path.read_bytes() == before
    assert torch.equal(torch.load(other, weights_only=True)["state_dict"]["w"], torch.full((5,), 2.0))
    convert_checkpoint_to_fp32_state_dict(path, other, overwrite=True)
    assert torch.equal(torch.load(other, weights_only=True)["w"], torch.ones(5))
    with pytest.raises(CheckpointError, match="the checkpoint itself"):
        convert_checkpoint_to_fp32_state_dict(path, path, overwrite=True)


def _mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether ``tensor``'s bytes lie in a mapping of the file ``path`` (``/proc/self/maps``)."""
    address = tensor.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == str(path):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                if start <= address < end:
                    return True
    return False


def test_a_full_checkpoint_loads_memory_mapped_and_a_legacy_file_still_loads(tmp_path):
    """Each rank of a resume reads the pages it copies (its shard of the moments), not the whole file."""
    saved = {"state_dict": {"w": torch.randn(64, 64)}, "epoch": 3}
    ckpt.atomic_save(saved, tmp_path / "new.ckpt")
    loaded = ckpt.load_checkpoint_file(tmp_path / "new.ckpt")
    assert torch.equal(loaded["state_dict"]["w"], saved["state_dict"]["w"]) and loaded["epoch"] == 3
    assert _mapped_from(loaded["state_dict"]["w"], tmp_path / "new.ckpt")
    # torch maps only its zip format: a file of torch < 1.6's format is read, not reported as damaged.
    torch.save(saved, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    legacy = ckpt.load_checkpoint_file(tmp_path / "legacy.ckpt")
    assert torch.equal(legacy["state_dict"]["w"], saved["state_dict"]["w"])
    assert not _mapped_from(legacy["state_dict"]["w"], tmp_path / "legacy.ckpt")

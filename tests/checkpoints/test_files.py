"""Checkpoint files (checkpoints/files.py, full.py): crash safety at every step of a save, safe temporaries,
the mode torch.save gives, corruption and pickled code named on load, memory-mapped loads."""

import errno
import io
import os
import random
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import crash_at, full_checkpoint, load_w, save, save_sharded_one_rank
from workers.checkpoints import in_version

from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload import convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.checkpoints import META_FILE, CheckpointError
from lightning_zero_offload.checkpoints import sharded as checkpoint_sharded
from lightning_zero_offload.checkpoints import writer as checkpoint_writer


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_a_kill_at_any_step_of_a_save_leaves_a_checkpoint_and_the_next_save_cleans_up(tmp_path, fmt):
    path = tmp_path / "last.ckpt"
    crashes = 0
    for step in range(1, 100):
        for after in (False, True):
            save(fmt, path, 1.0)
            if not crash_at(step, after, lambda: save(fmt, path, 2.0)):
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


class FillsUp(io.BytesIO):
    """A file on a disk with room for ``room`` bytes."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


@pytest.mark.parametrize("room", [0, 200, 3000])
def test_a_full_disk_midway_is_reported_as_the_os_reports_it(room):
    """Where the first write went through, torch.save turned the OSError into its own "unexpected pos 64 vs 0"."""
    with pytest.raises(OSError, match="No space left on device") as caught:
        checkpoint_writer.write_torch_file({"w": torch.ones(1000)}, FillsUp(room))
    assert caught.value.errno == errno.ENOSPC
    assert checkpoint_writer.write_torch_file({"w": torch.ones(10)}, FillsUp(10**6)).size > 0  # room: written


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

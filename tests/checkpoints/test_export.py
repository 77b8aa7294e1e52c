"""The fp32 export (checkpoints/export.py): zero-offload-convert's refusals and one-line errors, and the same
refusals from the Python function."""

import pytest
import torch
from checkpoint_helpers import full_checkpoint, save_sharded_one_rank

from lightning_zero_offload import checkpoints as ckpt
from lightning_zero_offload import convert_checkpoint_to_fp32_state_dict
from lightning_zero_offload.checkpoints import CheckpointError, export


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

import json
import sys

import pytest
from planner_helpers import H200_BOX, h200

from lightning_zero_offload.demo.model import GPT
from lightning_zero_offload.planner import (
    largest_models,
)
from lightning_zero_offload.planner.cli import main


def test_cli_with_presets(capsys):
    code = main(["--params", "1.3e9", "--batch-size", "4", "--seq-len", "1024", "--host", "Grace (GH200, LPDDR5X)"]
                + ["--device", "GH200 (NVLink-C2C)"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "1300.0M trainable params" in out and "recommended: cpu_step=" in out and "GH200" in out
    main(["--model", "lightning_zero_offload.demo.GPT", "--model-args", '{"n_layer": 2}', "--json", "--batch-size"]
         + ["2", "--seq-len", "64", "--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"]
         + ["--h2d-gbs", "1"])  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert data["params"] == sum(p.numel() for p in GPT(n_layer=2).parameters())
    assert data["machine"]["h2d_gbs"] == 1.0 and data["fits"] is True


def test_cli_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--params", "10", "--batch-size", "1", "--seq-len", "8", "--host", "Grace (GH200, LPDDR5X)"])
    assert exc.value.code == 2 and "--host and --device go together" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # no silent 1-token step: batch and sequence length are required
        main(["--params", "10", "--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"])
    assert exc.value.code == 2 and "--batch-size, --seq-len" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (
            ["--hidden", "-5"],
            "argument --hidden: '-5' must be above zero and finite",
        ),  # planned -4871 GB per GPU, "fits"
        (["--host-bandwidth-gbs", "-60"], "argument --host-bandwidth-gbs: '-60' must be above zero and finite"),
        (
            ["--host-memory-gb", "-10"],
            "argument --host-memory-gb: '-10' must be above zero and finite",
        ),  # "DOES NOT FIT", exit 3
        (["--device-tflops", "0"], "argument --device-tflops: '0' must be above zero and finite"),  # ZeroDivisionError
        (["--batch-size", "0"], "argument --batch-size: '0' must be above zero and finite"),  # a traceback
        (["--params", "0.5"], "argument --params: '0.5' is not a whole number"),  # planned as 0
        (["--host-bandwidth-gbs", "inf"], "argument --host-bandwidth-gbs: 'inf' must be above zero and finite"),
        (["--link-latency-s", "-1"], "argument --link-latency-s: '-1' must be zero or more and finite"),
        (["--model", "no_such_package.Model"], "ModuleNotFoundError: No module named 'no_such_package'"),
        # The rest raised a traceback.
        (["--params", "1e30"], "argument --params: '1e30' is more parameters than the planner takes (at most 1e+15)"),
        (["--device-type", "tpu"], "argument --device-type: 'tpu' is not a torch device type"),
        (["--model", "torch.nn.Linear"], "--model-args {}: missing a required argument: 'in_features'"),
        (
            ["--model", "torch.nn.Linear", "--model-args", '{"in_features": 8, "out_features": 8, "nope": 1}'],
            "unexpected keyword argument 'nope'",
        ),
        (["--model", "torch.nn.Linear", "--model-args", "[8, 8]"], "--model-args must be a JSON object"),
        (["--model", "collections.OrderedDict"], "built a OrderedDict, not an nn.Module"),
    ],
)
def test_impossible_numbers_and_models_are_usage_errors(given, said, capsys):
    """Each was planned with negative memory or time, or raised a traceback with exit status 1."""
    arguments = ["--batch-size", "4", "--seq-len", "2048", "--host", "Grace (GH200, LPDDR5X)"]
    arguments += ["--device", "GH200 (NVLink-C2C)"]
    what = [] if "--model" in given else ["--params", "1e9"]
    with pytest.raises(SystemExit) as exc:
        main([*what, *arguments, *given])
    assert exc.value.code == 2 and said in capsys.readouterr().err
    assert main(["--params", "1e9", *arguments, "--link-latency-s", "0"]) == 0  # a what-if, not a typo


H200_ARGS = ["--host", "server (1 socket, 8ch DDR4-3200)", "--device", "H200 SXM (PCIe 5)", "--host-memory-gb", "128"]


def test_cli_largest(capsys):
    box = [*H200_ARGS, "--device-memory-gb", "141", "--cpu-cores", "16"]
    assert main(["--largest", *box]) == 0
    out = capsys.readouterr().out
    assert out.startswith("largest model that trains on") and "micro-batch 1 x 2048 tokens" in " ".join(out.split())
    assert str(largest_models(H200_BOX)) in out  # the same machine as H200_BOX
    assert main(["--largest", *box, "--seq-len", "4096", "--activation-checkpointing", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert "micro-batch 1 x 4096 tokens, activation checkpointing on" in data["assumptions"]
    assert [r["setup"] for r in data["rows"]][:3] == ["plain", "fp32", "bf16"]
    tiny = ["--host-memory-gb", "1", "--device-memory-gb", "1"]  # nothing of 32 layers x 2048 tokens fits
    assert main(["--largest", *H200_ARGS, *tiny, "--n-layer", "32", "--batch-size", "64"]) == 3
    capsys.readouterr()
    with pytest.raises(SystemExit, match="--largest needs a GPU"):
        main(["--largest", *H200_ARGS, "--device-type", "cpu"])


@pytest.mark.slow  # the CLI in a fresh interpreter
def test_a_configuration_that_does_not_fit_exits_non_zero():
    import subprocess
    import sys

    args = ["--params", "70e9", "--n-layer", "80", "--hidden", "8192", "--batch-size", "1", "--seq-len", "2048"]
    done = subprocess.run(
        [sys.executable, "-m", "lightning_zero_offload.planner", *args, *H200_ARGS],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout.splitlines()[3].startswith("DOES NOT FIT") and "device memory per GPU" in done.stdout
    fits = ["--params", "1.3e9", "--n-layer", "24", "--batch-size", "1", "--seq-len", "2048"]
    assert main([*fits, *H200_ARGS]) == 0


def test_the_bf16_state_fix_is_offered_when_the_user_asked_for_the_undo_rollback():
    """The fix is bf16 state with its own (snapshot) rollback: asking for "undo" must not make planning fail."""
    p = h200("7B", speculation_rollback="undo")
    assert not p.fits
    assert any(f.startswith('cpu_state="bf16"') for f in p.fixes)


GH200 = ["--batch-size", "1", "--seq-len", "64", "--host", "Grace (GH200, LPDDR5X)", "--device", "GH200 (NVLink-C2C)"]


def test_a_hugging_face_model_without_transformers_names_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    for spec in (str(tmp_path), str(tmp_path / "config.json"), "meta-llama/Llama-3.1-8B"):
        with pytest.raises(SystemExit, match=r"is a Hugging Face model: planning it needs transformers \(pip"):
            main(["--model", spec, *GH200])
    with pytest.raises(SystemExit, match=r"a dotted path like package.module.Class; as a Hugging Face hub id, plan"):
        main(["--model", "GPT", *GH200])


@pytest.mark.slow  # transformers
def test_a_hugging_face_model_is_planned_from_its_config(tmp_path, capsys):
    from offload_params_helpers import tiny_llama_config
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    config.save_pretrained(tmp_path)
    want = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    for spec, overrides, layers in ((tmp_path, "{}", 3), (tmp_path / "config.json", '{"num_hidden_layers": 5}', 5)):
        main(["--model", str(spec), "--model-args", overrides, "--json", "--offload-params", *GH200])
        data = json.loads(capsys.readouterr().out)
        block = want - sum(p.numel() for p in LlamaForCausalLM(config).model.layers[0].parameters()) * (3 - layers)
        assert data["params"] == block and data["params_offload"]["units"]["units"] == layers  # the blocks
    with pytest.raises(SystemExit, match=r"--model 'nobody/nothing': no Hugging Face config there"):
        main(["--model", "nobody/nothing", *GH200])
    with pytest.raises(SystemExit, match=r"--model 'gpt2': no Hugging Face config there"):  # a hub id, not a class
        main(["--model", "gpt2", *GH200])
    with pytest.raises(SystemExit) as exc:  # a misspelt field planned the model unchanged
        main(["--model", str(tmp_path), "--model-args", '{"num_hiden_layers": 5}', *GH200])
    said = capsys.readouterr().err
    assert exc.value.code == 2 and "--model-args ['num_hiden_layers']: not fields of LlamaConfig" in said

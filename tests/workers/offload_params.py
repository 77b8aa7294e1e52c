"""The parameter-offload mode at several gloo ranks (top-level functions: ``ranks.run_ranks`` starts them):
placement, materialization and loading (each rank asserts its own results and returns what the test
compares across ranks), and the engine against FSDP2 + torch AdamW on the same shards, the issue's anchor
(what Lightning's ModelParallelStrategy runs: torch's AdamW stepping the shards, ``clip_grad_norm_`` over them)."""

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the helpers

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from offload_params_helpers import (  # noqa: E402
    Blocks,
    Net,
    assert_same_state,
    batches,
    full_state,
    loss_of,
    sharded_copy,
    tiny_llama_config,
    tokens,
    train,
    two_groups,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

from lightning_zero_offload.engine import OffloadOptions  # noqa: E402
from lightning_zero_offload.engine.offload_params import ParamOffloadEngine  # noqa: E402
from lightning_zero_offload.engine.offload_params.full_state import full_optimizer_state  # noqa: E402
from lightning_zero_offload.engine.offload_params.placement import device_resident, shard_model  # noqa: E402
from lightning_zero_offload.engine.offload_params.pretrained import load_pretrained, local_index  # noqa: E402


def materialized_like_rank0(rank: int) -> None:
    """Each rank builds on the meta device from its own seed; every rank ends with rank 0's values, which
    are those of the eager build from rank 0's seed, bitwise (tied or not, units chosen or the user's)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for tied in (False, True):
        for users_units in (False, True):
            torch.manual_seed(0)
            eager = Net(tied)
            torch.manual_seed(rank)
            with torch.device("meta"):
                net = Net(tied)
            if users_units:
                for block in net.blocks:
                    fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            shard_model(net, mesh, param_dtype=torch.float32)
            assert net.blocks[0].up.weight.to_local().shape[0] == (14, 13)[rank]  # 27 rows: uneven shards
            assert_same_state(net, eager)
            assert torch.equal(net(tokens()), eager(tokens()))


def frozen_gradients(rank: int) -> float:
    """Frozen parts (a block, part of one, the embedding) at two ranks, each rank half the batch: the
    largest gradient difference to the whole batch on one unsharded model (rounding of the reduce)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for build in ("eager", "meta"):
        torch.manual_seed(0)
        with torch.device("meta" if build == "meta" else "cpu"):
            net = Net()
        for frozen in (net.embed, net.blocks[0], net.blocks[1].up):
            frozen.requires_grad_(False)
        models.append(net)
    eager, net = models
    shard_model(net, mesh, param_dtype=torch.float32)
    eager(tokens()).square().mean().backward()
    net(tokens().chunk(2)[rank]).square().mean().backward()
    worst = 0.0
    for (name, p), q in zip(net.named_parameters(), eager.parameters(), strict=True):
        assert (p.grad is None) == (not q.requires_grad), name
        if p.grad is not None:
            worst = max(worst, (p.grad.full_tensor() - q.grad).abs().max().item() / q.grad.abs().max().item())
    return worst


def loaded_rows(directory: str, rank: int) -> None:
    """Every rank reads its own rows of a safetensors file into the sharded model: the whole tensors equal
    the file's bitwise; the rows each rank takes are distribute_tensor's."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    source = torch.load(os.path.join(directory, "source.pt"), weights_only=True)
    with torch.device("meta"):
        net = Net()
    shard_model(net, mesh, param_dtype=torch.float32, initialize=False)
    assert load_pretrained(net, directory) == ([], [])
    assert all(torch.equal(t, source[name]) for name, t in full_state(net).items())
    for shape in ((5, 3), (1, 4), (2,), (0, 2), (7, 2, 3)):
        whole = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        ours = distribute_tensor(whole, mesh, [Shard(0)])
        assert torch.equal(whole[local_index(ours)], ours.to_local()), shape


def hugging_face_llama(directory: str, rank: int) -> dict:
    """The tiny Llama saved by the test (index of several files): built on the meta device, sharded, loaded;
    its whole parameters bitwise those of the eager model, its logits returned. Then the same model built
    from its configuration (initialized) trains a step."""
    from transformers import LlamaForCausalLM

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    eager = LlamaForCausalLM(tiny_llama_config()).eval()
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_llama_config())
    shard_model(model, mesh, param_dtype=torch.float32, initialize=False)
    assert load_pretrained(model, directory) == ([], [])
    assert_same_state(model, eager)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model.eval()(ids).logits
    with torch.device("meta"):
        fresh = LlamaForCausalLM(tiny_llama_config())
    shard_model(fresh, mesh, param_dtype=torch.float32)
    assert torch.equal(fresh.model.rotary_emb.inv_freq, eager.model.rotary_emb.inv_freq)
    loss = fresh(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in fresh.parameters())
    return {"logits": logits, "eager_logits": eager(ids).logits.detach(), "loss": loss.item()}


ROWS = 12  # divisible by 1, 2 and 3 ranks


def rows_of(tensor: torch.Tensor) -> torch.Tensor:
    world, rank = dist.get_world_size(), dist.get_rank()
    return tensor.chunk(world)[rank]


def engine_against_fsdp2_adamw(rank: int, cpu_step: str, clip_norm: float | None) -> dict:
    torch.manual_seed(0)
    model = Blocks()
    data = batches(steps=4, micro=2, rows=ROWS)
    ours, reference = sharded_copy(model), sharded_copy(model)
    engine = ParamOffloadEngine(
        torch.optim.AdamW(two_groups(ours)),
        torch.device("cpu"),
        torch.float32,
        OffloadOptions(offload_params=True, cpu_step=cpu_step),
        world_size=dist.get_world_size(),
    )
    adamw = torch.optim.AdamW(two_groups(reference))
    for window in data:
        for index, (x, y) in enumerate(window):
            if index == len(window) - 1:
                engine.expect_step(publish_early=True)
            engine.begin_backward()
            loss_of(ours, rows_of(x), rows_of(y), len(window)).backward()
            engine.finish_backward()
            loss_of(reference, rows_of(x), rows_of(y), len(window)).backward()
        stats = engine.step(clip_norm=clip_norm)
        engine.zero_grad()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm)
        adamw.step()
        adamw.zero_grad()
    saved = full_optimizer_state(engine)  # a collective: rank 0 alone keeps the whole moments
    moments = {i: {k: s[k] for k in ("exp_avg", "exp_avg_sq")} for i, s in saved["state"].items()}
    params = [p for group in adamw.param_groups for p in group["params"]]
    reference_moments = {
        i: {k: adamw.state[p][k].full_tensor() for k in ("exp_avg", "exp_avg_sq")} for i, p in enumerate(params)
    }
    engine.close()
    return {
        "ours": full_state(ours),
        "reference": full_state(reference),
        "last_norm": stats.grad_norm,
        "moments": moments,
        "reference_moments": reference_moments,
    }


def shares_trained(rank: int) -> dict:
    """The weights after four steps (two micro-batches each, a clip that fires), each rank on its rows, for each
    state dtype, schedule and device share (0: every shard on the host): what tests/engine/offload_params/
    test_ranks.py compares."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = Blocks()
    data = batches(steps=4, micro=2, rows=ROWS)
    results = {}
    for cpu_state, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for cpu_step in ("sync", "speculative"):
            for share in (0.0, 0.5):
                sharded = copy.deepcopy(model).to(dtype)
                shard_model(sharded, mesh, param_dtype=dtype, device_share=share, pin_memory=False)
                chosen = {"cpu_state": cpu_state, "cpu_step": cpu_step, "device_share": share}
                options = OffloadOptions(offload_params=True, **chosen)
                engine = ParamOffloadEngine(
                    torch.optim.AdamW(two_groups(sharded)),
                    torch.device("cpu"),
                    dtype,
                    options,
                    world_size=dist.get_world_size(),
                    on_device=device_resident(sharded),
                )
                assert any(slot.on_device for slot in engine.slots) == (share > 0)
                train(sharded, engine, data, clip_norm=0.4)
                engine.close()
                results[cpu_state, cpu_step, share] = full_state(sharded)
    return results

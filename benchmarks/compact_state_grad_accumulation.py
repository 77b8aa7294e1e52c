"""What a bf16 gradient buffer costs under accumulation: its error against an fp32 buffer, per micro-batch count.

With ``cpu_state="bf16"`` the gradient buffer is bf16 (2 B/param instead of 4): each backward pass's
gradient is added in fp32 and the sum rounded to nearest once per pass (engine/step/cpu_state.py,
``CpuState.accumulate``). This measures what that rounding does to the accumulated gradient of a real model
(the demo's GPT on the demo corpus), for K micro-batches per step: the relative error of the bf16 buffer
against the same gradients summed in fp32, next to the error a single bf16 rounding of the fp32 sum
already has (the floor any 2-byte buffer has) and the micro-batch noise (how much the K-batch gradient
itself varies between steps), which is what training has to tolerate anyway.

    python benchmarks/compact_state_grad_accumulation.py [--micro-batches 1 2 4 8 16]
"""

from __future__ import annotations

import argparse

import torch

from lightning_zero_offload.demo import GPT, StdlibCorpusDataModule


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = StdlibCorpusDataModule(block_size=128, batch_size=args.batch_size, max_bytes=2_000_000)
    data.setup("fit")
    model = GPT(n_layer=4, n_head=4, n_embd=256, dropout=0.0)
    params = [p for p in model.parameters() if p.requires_grad]
    batches = iter(data.train_dataloader())

    def flat_grad() -> torch.Tensor:
        x, y = next(batches)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in params])

    print(f"demo GPT, {sum(p.numel() for p in params) / 1e6:.2f}M params, micro-batch {args.batch_size} x 128 bytes")
    print(f"{'K':>3} {'bf16 buffer vs fp32':>20} {'one rounding (floor)':>21} {'ratio':>6} {'step-to-step noise':>19}")
    rows = []
    for k in args.micro_batches:
        grads = [flat_grad() for _ in range(2 * k)]
        exact = torch.stack(grads[:k]).double().sum(0).float()
        buffer = grads[0].to(torch.bfloat16)
        for g in grads[1:k]:
            buffer.add_(g)  # what CpuState.accumulate does: the sum in fp32, rounded to bf16 once per pass
        floor = relative(exact.to(torch.bfloat16).float(), exact)
        error = relative(buffer.float(), exact)
        noise = relative(torch.stack(grads[k:]).double().sum(0).float(), exact)
        rows.append((k, error, floor, noise))
        print(f"{k:>3} {error:20.2e} {floor:21.2e} {error / floor:6.2f} {noise:19.2e}")
    print("bytes per parameter of the gradient buffer: bf16 2, fp32 4 (x2 under cpu_step='delayed')")


if __name__ == "__main__":
    main()

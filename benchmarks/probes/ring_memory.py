"""Probe (one GPU): what a bounded ring costs and saves in a training step of backend "fused"
with its fused backward (``MEGAMOE_FUSED_BACKWARD=1``): the ring of every row (the routed
activations saved) against a ring of about a quarter of the rows (the forward keeps none, the
backward replays and differentiates one macrobatch of ring rows at a time), beside backend
"triton". Same weights and inputs for all; the gradients must be bitwise equal.

    PYTHONPATH=. python benchmarks/probes/ring_memory.py [--out probe.json]

Per preset: the step's median time (forward + backward, interleaved rounds), and the peak of
allocated memory during the step above what was allocated before it (weights, inputs).
"""

import argparse
import json
import os
import statistics

import torch

import megamoe
from megamoe.kernels.schedule import max_rows
from megamoe.shapes import get_preset
from megamoe.tools.bench_kernels import event_times_ms

os.environ["MEGAMOE_FUSED_BACKWARD"] = "1"

CASES = {"dsv3": 4096, "qwen3-30b": 8192}  # preset: tokens


def _variants(preset: str, tokens: int) -> dict[str, megamoe.MoEConfig]:
    p = get_preset(preset)
    base = p.config()
    rows = max_rows(tokens * p.top_k, base.num_experts, base.block_rows)
    quarter = max(base.minibatch_rows, rows // 4 // base.minibatch_rows * base.minibatch_rows)
    return {
        "triton": base,
        "fused, ring of every row": base,
        f"fused, ring of {quarter} of {rows} rows": p.config(ring_rows=quarter),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = torch.device("cuda")
    records = []
    for preset, tokens in CASES.items():
        configs = _variants(preset, tokens)
        gen = torch.Generator(device=dev).manual_seed(0)
        cfg0 = next(iter(configs.values()))
        x = torch.randn(tokens, cfg0.hidden_size, device=dev, generator=gen).bfloat16()
        x.requires_grad_(True)
        logits = torch.randn(tokens, cfg0.num_experts, device=dev, generator=gen)
        topk_w, topk_ids = logits.softmax(-1).topk(cfg0.top_k, dim=-1)
        topk_w.requires_grad_(True)
        dy = torch.randn(tokens, cfg0.hidden_size, device=dev, generator=gen).bfloat16()
        mods = {
            name: megamoe.MoE(
                cfg, backend="triton" if name == "triton" else "fused", device=dev, seed=1
            )
            for name, cfg in configs.items()
        }

        def step(mod):
            y = mod(x, topk_ids, topk_w)
            return torch.autograd.grad(y, [x, topk_w, *mod.parameters()], dy)

        grads, peaks = {}, {}
        for name, mod in mods.items():
            step(mod)  # (compile, warm up)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads[name] = step(mod)
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
        ref = grads["triton"]
        times: dict[str, list[float]] = {name: [] for name in mods}
        for _ in range(args.rounds):
            for name, mod in mods.items():
                times[name].append(statistics.median(event_times_ms(lambda m=mod: step(m), 5)))
        for name in mods:
            same = all(torch.equal(a, b) for a, b in zip(grads[name], ref))
            rec = dict(
                preset=preset,
                tokens=tokens,
                variant=name,
                ring_rows=configs[name].ring_rows,
                step_ms=statistics.median(times[name]),
                step_peak_gib=peaks[name],
                same_bits_as_triton=same,
            )
            records.append(rec)
            print(
                f"{preset:10s} {name:40s} step {rec['step_ms']:7.3f} ms  peak above inputs "
                f"{rec['step_peak_gib']:6.2f} GiB  bits of triton: {same}"
            )
        del mods, grads
        torch.cuda.empty_cache()
        if args.out:  # (after every preset: a run cut short keeps what it measured)
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), records=records), f, indent=1)


if __name__ == "__main__":
    main()

"""The bits of a layer's outputs on a fixed seeded input: one SHA-256 per output and gradient.

    python megamoe/tools/fingerprint.py --backend triton fused --out fp.json
    PYTHONPATH=/path/to/other/tree python megamoe/tools/fingerprint.py ...   # another version

Two source trees (or two settings) give the same bits exactly when their fingerprints are equal:
the check that a change which should not touch the arithmetic did not. The input is drawn from
``--seed`` on the CPU, so it does not depend on the device or on this package's version; only
the stable public API is used (``MoEConfig``, ``ExpertWeights``, ``functional.forward`` /
``backward``), so the same file fingerprints older versions too (run it as a file, with the
other tree first on ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import torch

# dsv3's layer on one GPU (32 experts of the 256, one shared expert), 4096 tokens
SHAPE = dict(
    hidden_size=7168, intermediate_size=2048, num_experts=32, top_k=8, shared_intermediate_size=2048
)
TOKENS = 4096


def digest(t: torch.Tensor | None) -> str | None:
    """SHA-256 of a tensor's bytes (None for a missing gradient)."""
    if t is None:
        return None
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


def problem(seed: int, device: torch.device):
    import megamoe

    cfg = megamoe.MoEConfig(**SHAPE)
    gen = torch.Generator().manual_seed(seed)
    h, i, e, k, i_s = (
        SHAPE[f]
        for f in (
            "hidden_size",
            "intermediate_size",
            "num_experts",
            "top_k",
            "shared_intermediate_size",
        )
    )

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    weights = megamoe.ExpertWeights(
        rnd(e, i, h, scale=h**-0.5),
        rnd(e, i, h, scale=h**-0.5),
        rnd(e, h, i, scale=i**-0.5),
        rnd(i_s, h, scale=h**-0.5),
        rnd(i_s, h, scale=h**-0.5),
        rnd(h, i_s, scale=i_s**-0.5),
    )
    ids = torch.rand(TOKENS, e, generator=gen).argsort(dim=1)[:, :k].to(device)
    w = torch.softmax(torch.randn(TOKENS, k, generator=gen), dim=1).to(device)
    return cfg, rnd(TOKENS, h), ids, w, weights, rnd(TOKENS, h)


def fingerprint(backend: str, seed: int, device: torch.device) -> dict[str, str | None]:
    from megamoe import functional

    cfg, x, ids, w, weights, dy = problem(seed, device)
    y, ctx = functional.forward(x, ids, w, weights, cfg, backend=backend)
    grads = functional.backward(ctx, dy)
    out = {"y": digest(y)}
    out.update({name: digest(g) for name, g in zip(grads._fields, grads)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", default=["triton", "fused"])
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--out", help="JSON file: {backend: {output: sha256}}")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fingerprint: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    result = {b: fingerprint(b, args.seed, device) for b in args.backend}
    for backend, fp in result.items():
        combined = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()
        print(
            f"{backend:8s} {combined[:16]}  "
            + " ".join(f"{k}={(v or '-')[:8]}" for k, v in fp.items())
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

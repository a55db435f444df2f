"""Probe (one GPU): where the host time of a Triton kernel launch goes, for every kernel that
backend "triton"'s training step launches.

    PYTHONPATH=. python benchmarks/probes/launch_overhead.py [--model qwen3-30b-a3b]
        [--tokens 4096] [--precision bf16|fp8] [--out p.json]

Records every launch of one training step (JITFunction.run's arguments), then replays each
kernel's launch with the same arguments, timing the host side of each part of Triton 3.6's
launch path separately (median microseconds of 200 launches, a device sync every 20 so the
queue never fills):

  * ``jit_run``: ``JITFunction.run`` as ``kernel[grid](...)`` calls it (everything below);
  * ``binder``: the generated argument binder (specialization of every argument);
  * ``compiled_run``: ``CompiledKernel.run`` with the bound arguments (the launcher: scratch
    allocation, one TMA descriptor encoding per descriptor argument, the C launch);
  * ``encode``: the descriptor encodings alone (``make_tensordesc_arg`` of each);
  * ``c_launch``: the C launch with the arguments already encoded.

Also the host microseconds of ``torch.empty`` and of ``TensorDescriptor.from_tensor``, the
step's host time through the autograd op and through ``functional.forward``/``backward``
directly, and ``cProfile``'s tables of the direct calls (outside the op, whose
``torch.compile``-disabled wrapper hides the frames under it from the profiler).
"""

import argparse
import json
import statistics
import time

import torch
from triton.backends.nvidia import driver as nv_driver
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.tools import harness

REPS, SYNC_EVERY = 200, 20


def host_us(fn, reps: int = REPS) -> float:
    times = []
    for i in range(reps):
        if i % SYNC_EVERY == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def record_launches(call) -> list:
    """(kernel, args, kwargs, grid) of every launch of ``call()``."""
    launches = []
    original = JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, dict(kwargs), grid))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = recording
    try:
        call()
    finally:
        JITFunction.run = original
    torch.cuda.synchronize()
    return launches


def inner_launcher(compiled):
    """The C launch function under Triton's descriptor-encoding wrapper (or itself), and
    whether there was a wrapper."""
    launch = compiled.run.launch
    for cell in getattr(launch, "__closure__", None) or ():
        if type(cell.cell_contents).__name__ == "builtin_function_or_method":
            return cell.cell_contents, True
    return launch, False


def probe_kernel(fn: JITFunction, args, kwargs, grid) -> dict:
    """The parts' host times for one kernel; a part that fails is reported, not fatal."""
    device = torch.cuda.current_device()
    stream = torch.cuda.current_stream().cuda_stream
    kw = dict(kwargs)
    compiled = fn.run(*args, grid=grid, warmup=False, **kw)
    binder = fn.device_caches[device][4]
    kw["debug"] = kw.get("debug", fn.debug) or False
    kw["instrumentation_mode"] = ""
    bound, _, _ = binder(*args, **kw)
    values = list(bound.values())
    g = tuple(grid) + (1,) * (3 - len(grid))
    descs = [v for v in values if isinstance(v, (TensorDescriptor, GluonDescriptor))]
    metas = getattr(compiled.metadata, "tensordesc_meta", None) or [None] * len(descs)
    hooks = (compiled.packed_metadata, None, None, None)

    def run_compiled():
        compiled.run(*g, stream, compiled.function, *hooks, *values)

    def encode():
        for d, m in zip(descs, metas):
            nv_driver.make_tensordesc_arg(d, m)

    c_launch, wrapped = inner_launcher(compiled)
    final, it = [], iter(metas)
    for v in values:
        if wrapped and isinstance(v, (TensorDescriptor, GluonDescriptor)):
            final.extend(nv_driver.make_tensordesc_arg(v, next(it)))
        else:
            final.append(v)
    launcher = compiled.run
    base = (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)

    parts = {
        "jit_run_us": lambda: fn.run(*args, grid=grid, warmup=False, **kwargs),
        "binder_us": lambda: binder(*args, **kw),
        "compiled_run_us": run_compiled,
        "encode_us": encode,
        "c_launch_us": lambda: c_launch(*g, stream, compiled.function, *base, *hooks, *final),
    }
    result = {"kernel": fn.__name__, "args": len(values), "descriptors": len(descs)}
    for name, part in parts.items():
        try:
            result[name] = host_us(part)
        except Exception as exc:  # a probe: report the part and go on
            result[name] = repr(exc)
    return result


def step_parts(case, config) -> dict:
    """Host microseconds of the layer's step by part: the backend's functions called directly,
    the same through the custom ops, and the forward and the backward through autograd (the
    eager ``autograd.Function`` the layer takes)."""
    from megamoe import functional, ops

    x, w = case.x.detach(), case.topk_weights.detach()
    inputs = (x, case.topk_ids, w, *case.weights, config.key, "", "triton", False)
    parts = {}
    with torch.no_grad():
        _, ctx = functional.forward(
            x, case.topk_ids, w, case.weights, config, backend="triton", check_values=False
        )
        _, saved = torch.ops.megamoe.moe_forward(*inputs)
        parts["direct_forward_us"] = host_us(
            lambda: functional.forward(
                x, case.topk_ids, w, case.weights, config, backend="triton", check_values=False
            ),
            reps=40,
        )
        parts["op_forward_us"] = host_us(lambda: torch.ops.megamoe.moe_forward(*inputs), reps=40)
        parts["direct_backward_us"] = host_us(
            lambda: functional.backward(ctx, case.grad_y), reps=40
        )
        parts["op_backward_us"] = host_us(
            lambda: torch.ops.megamoe.moe_backward(
                case.grad_y, x, case.topk_ids, w, *case.weights, saved, config.key, "", "triton"
            ),
            reps=40,
        )
    parts["saved_tensors"] = len(saved)

    def autograd_forward():
        return ops.moe(
            case.x,
            case.topk_ids,
            case.topk_weights,
            case.weights,
            config,
            backend="triton",
            check_values=False,
        )

    parts["autograd_forward_us"] = host_us(autograd_forward, reps=40)
    ys = [autograd_forward() for _ in range(40)]
    torch.cuda.synchronize()
    times = []
    for i, y in enumerate(ys):
        if i % SYNC_EVERY == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.backward(case.grad_y)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    parts["autograd_backward_us"] = statistics.median(times) * 1e6
    return parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--out")
    args = parser.parse_args()
    env = harness.init_distributed()
    case = harness.make_case(args.model, env, tokens=args.tokens)
    config = case.config.replace(precision=args.precision)
    call = harness.layer_call("triton", case, config, None, backward=True)
    for _ in range(3):
        call()
    launches = record_launches(call)
    seen, rows = set(), []
    for fn, a, kw, grid in launches:
        if fn.__name__ in seen:
            continue
        seen.add(fn.__name__)
        try:
            rows.append(probe_kernel(fn, a, kw, grid))
        except Exception as exc:  # a probe: report and go on
            rows.append({"kernel": fn.__name__, "error": repr(exc)})
        print(json.dumps(rows[-1]), flush=True)
    t = torch.empty(4096, 2048, dtype=torch.bfloat16, device="cuda")
    extra = {
        "torch_empty_us": host_us(
            lambda: torch.empty(4096, 2048, dtype=torch.bfloat16, device="cuda")
        ),
        "from_tensor_us": host_us(lambda: TensorDescriptor.from_tensor(t, [128, 64])),
        "launches_per_step": len(launches),
        "step_host_us": host_us(call, reps=20),
    }
    from megamoe import functional

    @torch.no_grad()
    def direct():
        y, ctx = functional.forward(
            case.x.detach(),
            case.topk_ids,
            case.topk_weights.detach(),
            case.weights,
            config,
            backend="triton",
            check_values=False,
        )
        functional.backward(ctx, case.grad_y)

    extra["direct_step_host_us"] = host_us(direct, reps=20)
    extra.update(step_parts(case, config))
    print(json.dumps(extra))
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(20):
        torch.cuda.synchronize()
        prof.enable()
        direct()
        prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats("megamoe", 45)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "precision": args.precision,
                    "tokens": case.tokens,
                    "kernels": rows,
                    **extra,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

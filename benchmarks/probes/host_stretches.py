"""Probe (one GPU): where the host time of backend "triton"'s training step goes, on the
launch path the layer really takes (direct launches included), through autograd as a training
loop calls it.

    PYTHONPATH=. python benchmarks/probes/host_stretches.py [--model qwen3-30b-a3b]
        [--tokens 4096] [--precision bf16 fp8] [--quantize-weights] [--reps 30] [--out p.json]

Puts a timer around ``launch`` in every megamoe kernel module and around the layer's functions
between the autograd call and the kernels (:data:`MARKED`: the op wrappers, validation,
schedule, save and restore, the backend's steps), runs the step ``--reps`` times, each after a
device sync (so no launch waits for a full queue), and prints the step's events in order (a
function's entry ``>name`` and exit ``<name``, a launch ``kernel`` and its return ``kernel.``)
with the median host microseconds since the previous event. A step's events are the same every
call. The timers add about a microsecond each.
"""

import argparse
import importlib
import json
import statistics
import time

import torch

from megamoe.kernels import checks, comm, fp8, fp8_gemm, fp8_ws, gemm, rows, runtime, schedule
from megamoe.tools import harness
from megamoe.tools.bench import forget_fp8_weights

LAUNCHING = (checks, comm, fp8, fp8_gemm, fp8_ws, gemm, rows, schedule)
# (module, attribute) of the functions whose entry and exit are marked; each is looked up
# through its module at every call, so the patched attribute is the one called
MARKED = [
    ("megamoe.ops", "_EagerMoE.forward"),
    ("megamoe.ops", "_EagerMoE.backward"),
    ("megamoe.ops", "_unpack"),
    ("megamoe.ops", "_weights"),
    ("megamoe.ops", "_save"),
    ("megamoe.functional", "forward"),
    ("megamoe.functional", "backward"),
    ("megamoe.functional", "validate_inputs"),
    ("megamoe.functional", "resolve_backend"),
    ("megamoe.backends.triton", "forward"),
    ("megamoe.backends.triton", "backward"),
    ("megamoe.backends.triton", "build_schedule"),
    ("megamoe.backends.triton", "save"),
    ("megamoe.backends.triton", "restore"),
    ("megamoe.backends.steps", "prepare"),
    ("megamoe.backends.steps", "local_forward"),
    ("megamoe.backends.steps", "local_backward"),
    ("megamoe.backends.steps", "routed_grads"),
    ("megamoe.backends.steps", "nan_if"),
    ("megamoe.backends.steps", "_step_weights"),
    ("megamoe.ep.checks", "lagged_check"),
]


def _patch(events: list) -> list:
    """Install the timers; returns what to restore."""
    saved = []

    def timed_launch(kernel, grid, *args, **options):
        events.append((time.perf_counter(), kernel.__name__))
        runtime.launch(kernel, grid, *args, **options)
        events.append((time.perf_counter(), kernel.__name__ + "."))

    for m in LAUNCHING:
        saved.append((m, "launch", m.launch))
        m.launch = timed_launch
    for module, attr in MARKED:
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        raw = owner.__dict__[name]
        fn = raw.__func__ if isinstance(raw, staticmethod) else raw

        def marked(*args, _fn=fn, _name=name, **kwargs):
            events.append((time.perf_counter(), ">" + _name))
            try:
                return _fn(*args, **kwargs)
            finally:
                events.append((time.perf_counter(), "<" + _name))

        saved.append((owner, name, raw))
        setattr(owner, name, staticmethod(marked) if isinstance(raw, staticmethod) else marked)
    return saved


def stretches(call, reps: int) -> dict:
    events: list = []
    saved = _patch(events)
    steps = []
    try:
        for _ in range(reps):
            if torch.cuda.is_available():  # (without: the interpreter, for a smoke test)
                torch.cuda.synchronize()
            events.clear()
            events.append((time.perf_counter(), "start"))
            call()
            events.append((time.perf_counter(), "end"))
            steps.append(list(events))
    finally:
        for owner, name, raw in reversed(saved):
            setattr(owner, name, raw)
    labels = [label for _, label in steps[0]]
    if any([label for _, label in s] != labels for s in steps):
        raise RuntimeError("the steps' events differ from call to call")
    out = [
        {"event": labels[i], "us": statistics.median((s[i][0] - s[i - 1][0]) * 1e6 for s in steps)}
        for i in range(1, len(labels))
    ]
    launch_us = sum(e["us"] for e in out if e["event"].endswith("."))
    return {
        "events": out,
        "step_us": statistics.median((s[-1][0] - s[0][0]) * 1e6 for s in steps),
        "launches": sum(e["event"].endswith(".") for e in out),
        "in_launches_us": launch_us,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp8"])
    parser.add_argument("--quantize-weights", action="store_true")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out")
    args = parser.parse_args()
    env = harness.init_distributed()
    case = harness.make_case(args.model, env, tokens=args.tokens)
    results = []
    for precision in args.precision:
        config = case.config.replace(precision=precision)
        step = harness.layer_call("triton", case, config, None, backward=True)
        quantize = args.quantize_weights and precision == "fp8"

        def call(step=step, quantize=quantize) -> None:
            if quantize:
                forget_fp8_weights()
            step()

        for _ in range(3):
            call()
        r = stretches(call, args.reps)
        r.update(precision=precision, quantize_weights=quantize)
        results.append(r)
        print(
            f"{args.model}, {args.tokens} tokens, {precision}"
            f"{' (weights quantized)' if quantize else ''}: step {r['step_us']:.0f} us of host "
            f"time, {r['in_launches_us']:.0f} of it in {r['launches']} launches"
        )
        for e in r["events"]:
            print(f"  {e['us']:7.1f}  {e['event']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "results": results}, f)


if __name__ == "__main__":
    main()

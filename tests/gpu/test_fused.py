"""Backend "fused" (the fused forward kernel) on Hopper GPUs, one GPU and expert-parallel.

    python -m pytest -q tests/gpu/test_fused.py                           # one GPU
    torchrun --nproc-per-node=2 -m pytest -q tests/gpu/test_fused.py      # W = 2 (+ W = 1)

Checked: outputs and every gradient (the fused forward's context through backend "triton"'s
backward, and at W = 1 through the fused backward, MEGAMOE_FUSED_BACKWARD=1; with a ring
smaller than the rows the backward replays the routed forward: backend "triton"'s all rows first,
the fused one macrobatch by macrobatch) bitwise equal to backend
"triton" for comm programs 4/16/32, minibatch sizes and ring sizes
(smaller than the work: several macrobatches; holding every row); against the float64 reference
(one GPU: presets and odd shapes; W = 2: via ep_vs_single); the watchdog turns a missing signal
into a StallError instead of a hang. Parametrizations are few on purpose: every distinct
(num_comm, minibatch, lag, shared) compiles the kernel again.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from megamoe import MoEConfig  # noqa: E402
from megamoe.backends import fused as fused_backend  # noqa: E402
from megamoe.backends import steps  # noqa: E402
from megamoe.backends import triton as triton_backend  # noqa: E402
from megamoe.ep import checks  # noqa: E402
from megamoe.ep.workspace import check_errors, local_workspace  # noqa: E402
from megamoe.errors import StallError  # noqa: E402
from megamoe.kernels import fused as ff  # noqa: E402
from megamoe.kernels.runtime import poisoned_buffers  # noqa: E402
from megamoe.reference import moe_reference  # noqa: E402
from megamoe.shapes import get_preset  # noqa: E402
from megamoe.tools.harness import layer_fn  # noqa: E402
from support.dist import agree, shared_seed  # noqa: E402
from support.expert_parallel import ep_vs_single  # noqa: E402
from support.oracle import compare, reference_grads, run_backend  # noqa: E402
from support.problems import PRESET_CASES, Case, case_of, make_problem  # noqa: E402

DEV = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
# Under torchrun the one-GPU tests run on every rank before any NCCL fixture picked the device.
torch.cuda.set_device(DEV)
BF16_RTOL = 2e-2
# The presets' layer shapes (one rank's experts), and odd ones; tokens keep the oracle quick.
CASES = {
    **PRESET_CASES,
    "empty_experts": Case(333, 512, 384, 16, 2, routing="empty_experts", block_rows=128),
    "one_expert_all_rows": Case(
        517, 768, 512, 8, 3, shared=256, routing="one_expert", block_rows=128
    ),
    "sizes_not_tile_multiples": Case(300, 520, 200, 6, 2, shared=136, block_rows=128),
}
# Rows the ring holds when a test does not pick: every row of these problems (the saved path).
LARGE_RING = 1 << 17
# (num_comm, minibatch rows, ring rows): ring smaller than qwen3-30b's ~8-16K rows at 1024 tokens
# per rank (several macrobatches, backward replay) and ring holding every row.
TUNABLES = [(4, 128, 1024), (16, 512, LARGE_RING), (32, 2048, 2048), (16, 256, 256)]
STALL_BUDGET = 1 << 12


def _bits_equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _fused_step(x, ids, w, weights, cfg, group, dy):
    sched = fused_backend.build_schedule(ids, cfg, group)
    y, ctx = fused_backend.forward(x, ids, w, weights, cfg, group, sched)
    return y, fused_backend.backward(ctx, dy), sched


def _triton_step(x, ids, w, weights, cfg, group, dy):
    sched = triton_backend.build_schedule(ids, cfg, group)
    y, ctx = triton_backend.forward(x, ids, w, weights, cfg, group, sched)
    return y, triton_backend.backward(ctx, dy), sched


def _differences(a, b) -> list[str]:
    names = ("y",) + a[1]._fields
    return [n for n, p, q in zip(names, (a[0], *a[1]), (b[0], *b[1])) if not _bits_equal(p, q)]


# ------------------------------------------------------------------------------ one GPU


def _single_problem(
    name: str, num_comm: int, minibatch_rows: int = 256, ring_rows: int = LARGE_RING
):
    return make_problem(
        CASES[name],
        seed=3,
        device=DEV,
        comm_programs=num_comm,
        minibatch_rows=minibatch_rows,
        ring_rows=ring_rows,
    )


def _run_fused(p):
    with poisoned_buffers():
        y, grads, _ = _fused_step(
            p.x, p.topk_ids, p.topk_weights, p.weights, p.config, None, p.grad_y
        )
    return y, grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_gpu_matches_reference_and_triton_bits(name: str) -> None:
    p = _single_problem(name, num_comm=16)
    ours = _run_fused(p)
    errors = compare(ours, reference_grads(p, torch.float64), reference_grads(p, torch.bfloat16))
    print(" ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert not _differences(ours, run_backend(p)), "not bitwise equal to backend triton"


@pytest.mark.parametrize("num_comm,minibatch_rows,ring_rows", TUNABLES)
def test_single_gpu_bits_do_not_depend_on_tunables(
    num_comm: int, minibatch_rows: int, ring_rows: int
) -> None:
    p = _single_problem("qwen3-30b", num_comm, minibatch_rows, ring_rows)
    bad = _differences(_run_fused(p), run_backend(p))
    assert not bad, (
        f"num_comm={num_comm} minibatch={minibatch_rows} ring={ring_rows}: {bad} differ from triton"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_single_gpu_fused_backward_gives_triton_bits(name: str, monkeypatch) -> None:
    """The fused backward kernel (opt-in) on the GPU: every gradient bitwise backend triton's,
    also with a ring smaller than the rows (replayed and differentiated per macrobatch); it ran
    (backward_kind)."""
    monkeypatch.setenv(fused_backend.FUSED_BACKWARD_ENV, "1")
    assert fused_backend.backward_kind(1) == "fused"
    for ring_rows in (None, 2048):
        p = _single_problem(name, num_comm=16, minibatch_rows=256, ring_rows=ring_rows)
        assert not _differences(_run_fused(p), run_backend(p)), (name, ring_rows)


FP8_CASES = ("dsv3", "qwen3-30b", "empty_experts", "one_expert_all_rows")


def _run_pipelined(p):
    """The pipelined fp8 forward's protocol (what W > 1 runs: the pulls beside the
    warp-specialized GEMMs, the push of z, the slots' combine) on a one-rank workspace (one
    process runs backend triton's forward), then the backward on its context, as
    ``fused.forward`` hands it over."""
    sched = fused_backend.build_schedule(p.topk_ids, p.config, None)
    with poisoned_buffers():
        x, w, weights, sched = steps.prepare(
            p.x, p.topk_ids, p.topk_weights, p.weights, p.config, None, sched
        )
        run = steps.single_rank(sched, p.topk_ids)
        ws = run.ep.workspace
        y, ctx = steps.run_steps(fused_backend.forward_steps(x, w, weights, run), ws)
        checks.eager_check(ws)
        ctx = dataclasses.replace(ctx, schedule=sched, slot_weights=w.view(-1))
        grads = fused_backend.backward(ctx, p.grad_y)
    return y, grads


@pytest.mark.parametrize(
    "comm_kernel", [None, True, False], ids=["pipelined", "comm-kernel", "one-kernel"]
)
@pytest.mark.parametrize("name", FP8_CASES)
def test_single_gpu_fp8_forward_gives_triton_fp8_bits(
    name: str, comm_kernel: bool | None, monkeypatch
) -> None:
    """precision "fp8": the fused forward (``comm_kernel`` None, the default: the pipelined
    protocol on a one-rank workspace, and with one process backend triton's forward; True /
    False: the fused kernel's fp8 tiles on the pulled packed rows with its h tasks) and backend
    triton's backward give backend triton's fp8 layer bit for bit (its GEMMs on this GPU the
    warp-specialized kernels), every buffer poisoned, and bitwise run to run (backend triton's
    fp8 layer against the recipe's bars: tests/gpu/test_fp8.py)."""
    monkeypatch.delenv(fused_backend.PIPELINED_FP8_ENV, raising=False)  # (the default)
    p = make_problem(
        CASES[name],
        seed=5,
        device=DEV,
        precision="fp8",
        minibatch_rows=256,
        ring_rows=None,
        comm_kernel=comm_kernel,
    )
    kinds = [fused_backend.forward_kind(p.config, DEV, w) for w in (1, 2)]
    runs = [_run_fused]
    if comm_kernel is None:
        assert kinds == ["unfused", "pipelined"]
        runs.append(_run_pipelined)
    else:
        assert kinds == [{True: "comm_kernel", False: "one_kernel"}[comm_kernel]] * 2
    triton_bits = run_backend(p)
    for run in runs:
        ours = run(p)
        assert torch.isfinite(ours[0]).all() and all(
            torch.isfinite(g).all() for g in ours[1] if g is not None
        )
        assert not _differences(ours, triton_bits), f"{name} {run.__name__}: not triton's fp8"
        assert not _differences(ours, run(p)), f"{name} {run.__name__}: not bitwise run to run"


@pytest.mark.parametrize("num_comm", [1, 40])
def test_single_gpu_pipelined_fp8_bits_do_not_depend_on_the_pull_programs(
    num_comm: int, monkeypatch
) -> None:
    """The pipelined fp8 forward with one pull program (the gate/up kernel waits for most row
    blocks) and with 40 (a third of the SMs): backend triton's fp8 bits."""
    monkeypatch.delenv(fused_backend.PIPELINED_FP8_ENV, raising=False)  # (the default)
    p = make_problem(
        CASES["qwen3-30b"],
        seed=6,
        device=DEV,
        precision="fp8",
        minibatch_rows=256,
        ring_rows=None,
        comm_programs=num_comm,
    )
    assert fused_backend.resolved_tunables(p.config, DEV, 2)["comm_programs"] == num_comm
    assert not _differences(_run_pipelined(p), run_backend(p)), num_comm


def test_single_gpu_comm_kernel_bits() -> None:
    """config.comm_kernel on one GPU: the comm kernel's programs beside the compute kernel's."""
    for name in ("dsv3", "sizes_not_tile_multiples"):
        p = _single_problem(name, num_comm=16)
        p = dataclasses.replace(p, config=p.config.replace(comm_kernel=True))
        assert not _differences(_run_fused(p), run_backend(p)), name


def test_single_gpu_shared_expert_and_ring_bits() -> None:
    """dsv3 (shared expert as the first tasks) with a ring smaller than the rows."""
    p = _single_problem("dsv3", num_comm=16, minibatch_rows=256, ring_rows=2048)
    assert not _differences(_run_fused(p), run_backend(p))


@pytest.mark.parametrize(
    "skip_tasks,ring_rows,stage",
    [
        (1, LARGE_RING, "fused forward"),  # tile 0 never signals
        (1 << 30, 256, "ring slot freed by the down tiles"),  # no down tile runs, the ring wraps
    ],
)
def test_watchdog_turns_a_missing_signal_into_an_error(
    skip_tasks: int, ring_rows: int, stage: str
) -> None:
    """Pre-advance the task ticket: skipped tasks never signal, the waits give up, no hang."""
    p = _single_problem("sizes_not_tile_multiples", num_comm=4)
    cfg, (t, h), k = p.config, p.x.shape, p.topk_ids.shape[1]
    sched = triton_backend.build_schedule(p.topk_ids, cfg, None).routed
    ws = local_workspace(t, h, k, torch.bfloat16, DEV)
    ws.x_buffer.copy_(p.x)
    flags = torch.zeros(1 << 16, dtype=torch.int32, device=DEV)
    flags[0] = skip_tasks
    ff.fused_forward(
        ws,
        sched,
        *p.weights[:3],
        num_comm=4,
        minibatch_rows=cfg.minibatch_rows,
        ring_rows=ring_rows,
        budget=STALL_BUDGET,
        flags=flags,
    )
    torch.cuda.synchronize()
    with pytest.raises(StallError, match=stage):
        check_errors(ws)
    # The workspace works again afterwards.
    assert not _differences(_run_fused(p), run_backend(p))


# ------------------------------------------------------------------------------ W ranks


fused_moe = layer_fn("fused")


@pytest.mark.parametrize("routing", ["uniform", "zipf", "one-rank"])
def test_ep_matches_reference(ep, routing: str) -> None:
    group, device = ep
    cfg = MoEConfig(1024, 512, 8 * dist.get_world_size(group), 4, shared_intermediate_size=256)
    reference64 = functools.partial(moe_reference, compute_dtype=torch.float64)
    errs = ep_vs_single(
        fused_moe,
        reference64,
        cfg,
        384,
        group,
        seed=shared_seed(device),
        routing=routing,
        device=device,
    )
    print(" ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    agree(max(errs.values()) < BF16_RTOL, str(errs))


@pytest.mark.parametrize("routing", ["uniform", "one-rank"])
def test_ep_bits_equal_triton_for_every_num_comm(ep, routing: str) -> None:
    group, device = ep
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seed = shared_seed(device)
    base = get_preset("qwen3-30b").config(world).replace(num_experts=16 * world)
    p = make_problem(case_of(base, 1024, routing, world), seed, device)
    weights, (x, ids, w, dy) = p.local_weights(rank), p.ranks[rank]
    expected = _triton_step(x, ids, w, weights, base, group, dy)
    problems = []
    # and the comm kernel beside the compute kernel (config.comm_kernel; a ring of every row)
    sets = [
        dict(comm_programs=n, minibatch_rows=mb, ring_rows=ring) for n, mb, ring in TUNABLES[:3]
    ] + [dict(comm_kernel=True, minibatch_rows=512, ring_rows=LARGE_RING)]
    for tunables in sets:
        cfg = base.replace(**tunables)
        out = _fused_step(x, ids, w, weights, cfg, group, dy)
        triton_backend.check(out[2])
        bad = _differences(out, expected)
        if bad:
            problems.append(f"{tunables}: {bad}")
    agree(not problems, "; ".join(problems))


def test_trace_records_every_task_and_pull_and_changes_no_bits() -> None:
    """fused_forward(trace=...): one event per task of the list and per (comm program, minibatch),
    each with end >= start, and the same outputs as the plain launch."""
    from megamoe.tools.fused_trace import KINDS, summarize

    p = _single_problem("sizes_not_tile_multiples", num_comm=4)
    cfg, (t, h), k = p.config, p.x.shape, p.topk_ids.shape[1]
    sched = triton_backend.build_schedule(p.topk_ids, cfg, None).routed
    ws = local_workspace(t, h, k, torch.bfloat16, DEV)
    ws.x_buffer.copy_(p.x)
    shared = (p.x, p.weights.s_gate, p.weights.s_up, p.weights.s_down)

    def launch(trace=None):
        return ff.fused_forward(
            ws,
            sched,
            *p.weights[:3],
            num_comm=4,
            minibatch_rows=cfg.minibatch_rows,
            shared=shared,
            trace=trace,
        )

    plain = launch()
    plain_slots = ws.combine_buffer.clone()
    trace = ff.new_trace(DEV, 1024)
    traced = launch(trace)
    torch.cuda.synchronize()
    check_errors(ws)
    used = int(sched.row_start[-1])  # rows past the used ones are never written (torch.empty)
    assert _bits_equal(traced.routed.z[:used], plain.routed.z[:used])
    assert _bits_equal(traced.shared_out, plain.shared_out)
    assert _bits_equal(ws.combine_buffer, plain_slots)
    ev = trace.cpu()
    written = ev[:, :, 0] >= 0
    assert bool((ev[:, :, 2][written] >= ev[:, :, 1][written]).all())
    kinds = (ev[:, :, 0][written] >> 32).tolist()
    from triton import cdiv

    from megamoe.kernels.gemm import tiles_for

    bm, bn1, bn2 = sched.block_rows, tiles_for("gate_up").bn, tiles_for("mm").bn
    blocks = int(sched.num_blocks.item())
    group = cfg.minibatch_rows // bm  # task-list groups: a partial last one counts whole
    n2 = cdiv(h, bn2)
    routed = cdiv(blocks, group) * group * (cdiv(cfg.intermediate_size, bn1) + n2)
    shared_tasks = cdiv(cdiv(t, bm), group) * group * (cdiv(cfg.shared_intermediate_size, bn1) + n2)
    pulls = 4 * cdiv(blocks * bm, cfg.minibatch_rows)
    assert len(kinds) == routed + shared_tasks + pulls
    assert kinds.count(0) == pulls and set(kinds) <= set(KINDS)
    assert summarize(trace.cpu(), num_comm=4)["kinds"]["down"]["count"] > 0


def test_auto_takes_fused_for_a_wide_layer_and_keeps_the_bits() -> None:
    """backend="auto" on one GPU: the dsv3 layer at 4096 tokens (7168 x 2048, 32768 rows) runs
    the fused forward, the same layer with few rows the unfused; either way triton's bits."""
    from megamoe import functional
    from megamoe.tools import fingerprint

    cfg, x, ids, w, weights, dy = fingerprint.problem(seed=4, device=DEV)
    y, ctx = functional.forward(x, ids, w, weights, cfg, backend="auto")
    assert ctx.backend == "fused"
    y_ref, ctx_ref = functional.forward(x, ids, w, weights, cfg, backend="triton")
    assert torch.equal(y, y_ref)
    grads, grads_ref = functional.backward(ctx, dy), functional.backward(ctx_ref, dy)
    for name, a, b in zip(grads._fields, grads, grads_ref):
        assert a is None or torch.equal(a, b), name
    few = functional.forward(x[:512], ids[:512], w[:512], weights, cfg, backend="auto")[1]
    assert few.backend == "triton"  # 4096 rows: too few to fill the wide GEMMs

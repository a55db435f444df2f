"""The copy-bandwidth benchmark's arithmetic and plumbing (``megamoe.tools.bench_comm``)."""

import os

import pytest
import torch


def test_remote_gbps():
    from megamoe.tools.bench_comm import remote_gbps

    assert remote_gbps([3_000_000, 1_000_000], 0.01) == pytest.approx(300.0)  # 3 MB in 10 us
    assert remote_gbps([0, 0], 1.0) == 0.0


def needs_interpreter(test):
    """Emulated ranks run their kernels in the Triton interpreter (tests/conftest.py)."""
    skip = pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
        reason="emulated ranks need the Triton interpreter",
    )
    quiet = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
    return skip(quiet(test))


def _emulated_pair(t: int = 8, h: int = 32, k: int = 2, e_local: int = 2, block_rows: int = 16):
    """Two emulated ranks with random routing, published, and each rank's schedule."""
    from megamoe.ep.workspace import emulated_workspaces, publish
    from megamoe.kernels.schedule import build_row_schedule

    gen = torch.Generator().manual_seed(5)
    ws = emulated_workspaces(2, t, h, k)
    ids = [torch.rand(t, 2 * e_local, generator=gen).argsort(dim=1)[:, :k] for _ in ws]
    for w, i in zip(ws, ids):
        publish(
            w,
            x=torch.randn(t, h, generator=gen).to(torch.bfloat16),
            topk_ids=i,
            topk_weights=torch.rand(t, k, generator=gen),
            dy=torch.randn(t, h, generator=gen).to(torch.bfloat16),
        )
    all_ids = torch.cat(ids).to(torch.int32)
    scheds = [
        build_row_schedule(all_ids, e_local, block_rows, expert_lo=r * e_local) for r in range(2)
    ]
    return ws, ids, scheds, e_local


@needs_interpreter
def test_remote_rows_count_only_other_ranks_tokens():
    from megamoe.tools.bench_comm import remote_rows

    ws, ids, scheds, e_local = _emulated_pair()
    for r in range(2):
        peer = ids[1 - r]  # entries of the other rank's tokens routed to r's experts
        want = int((peer // e_local == r).sum())
        assert want > 0 and remote_rows(ws[r], scheds[r]) == want


@needs_interpreter
def test_layer_comm_gbps_runs_each_copy_with_the_programs(monkeypatch):
    """The plumbing of the bench's GPU path, with the device timing replaced by fixed times:
    each of the four copies really runs (interpreter) with the given programs."""
    from megamoe.kernels import comm
    from megamoe.tools import bench_comm

    ws, _, scheds, _ = _emulated_pair()
    launches: list[tuple[str, int]] = []

    def spy(name, real):
        def run(*args, **kw):
            launches.append((name, kw["programs"]))
            return real(*args, **kw)

        return run

    monkeypatch.setattr(comm, "dispatch_pull", spy("pull", comm.dispatch_pull))
    monkeypatch.setattr(comm, "combine_push", spy("push", comm.combine_push))

    def fake_time_op(ws, fn, iters, warmup, group=None):
        fn()
        return [4.0, 2.0, 1.0]  # median 2 ms

    monkeypatch.setattr(bench_comm, "time_op", fake_time_op)
    monkeypatch.setattr(
        bench_comm, "remote_bytes_per_rank", lambda ws, sched, group=None: [2_000_000, 1_000_000]
    )
    got = bench_comm.layer_comm_gbps(ws[0], scheds[0], programs=3, iters=3, warmup=0)
    assert got == {
        f: pytest.approx(1.0)
        for f in ("dispatch_gbps", "combine_gbps", "dispatch_bwd_gbps", "combine_bwd_gbps")
    }
    assert launches == [("pull", 3), ("push", 3), ("pull", 3), ("push", 3)]

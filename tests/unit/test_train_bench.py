"""`megamoe train-bench` on the CPU: the tiny models in float32, native against megamoe's reference
backend. Record fields and types, the FLOP count against a hand count, forced-balanced routing,
the run order, the CLI's errors and loss parity step by step.

The megamoe experts implementation is a stand-in registered here in transformers'
ExpertsInterface (megamoe.functional.moe with ExpertWeights.from_gate_up), so these tests do not
depend on megamoe.integrations.transformers.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

import megamoe  # noqa: E402
from megamoe.tools import cli  # noqa: E402
from megamoe.tools import train_bench as tb  # noqa: E402

CPU = torch.device("cpu")


def standin_experts_key(backend: str, precision: str = "bf16") -> str:
    """Register an experts forward that runs megamoe ``backend`` in ``precision`` on the
    module's own weights and return its key (what megamoe.integrations.transformers'
    experts_implementation does)."""
    from transformers.integrations.moe import ExpertsInterface

    def forward(self, hidden_states, top_k_index, top_k_weights):
        h, i = hidden_states.shape[-1], self.down_proj.shape[-1]
        e, k = self.gate_up_proj.shape[0], top_k_index.shape[-1]
        cfg = megamoe.MoEConfig(h, i, e, k, precision=precision)
        weights = megamoe.ExpertWeights.from_gate_up(self.gate_up_proj, self.down_proj)
        y = megamoe.functional.moe(
            hidden_states, top_k_index, top_k_weights.float(), weights, cfg, backend=backend
        )
        return y.to(hidden_states.dtype)

    key = f"megamoe_test_{backend}_{precision}"
    ExpertsInterface.register(key, forward)
    return key


@pytest.fixture(autouse=True)
def _standin(monkeypatch):
    monkeypatch.setattr(tb, "megamoe_experts_key", standin_experts_key)


def _opts(**kw) -> tb.TrainOptions:
    kw.setdefault("device", CPU)
    return tb.TrainOptions(**kw)


@pytest.fixture(scope="module")
def records():
    """One CPU run of both tiny models, both impls and routings, two rounds."""
    mp = pytest.MonkeyPatch()
    mp.setattr(tb, "megamoe_experts_key", standin_experts_key)
    try:
        opts = _opts(steps=2, warmup=1, rounds=2)
        return tb.run_train_bench(opts)
    finally:
        mp.undo()


# ------------------------------------------------------------------------------------ records


def test_records_fields_and_types(records):
    assert len(records) == 2 * 2 * 2  # models x routings x impls
    assert {(r["model"], r["routing"], r["impl"]) for r in records} == {
        (m, r, i)
        for m in ("dsv3-tiny", "qwen3-30b-a3b-tiny")
        for r in ("learned", "balanced")
        for i in ("native", "megamoe-reference")
    }
    for r in records:
        assert list(r) == list(tb.RECORD_FIELDS)
        assert r["status"] == "ok", r["note"]
        assert r["kind"] == "train" and r["precision"] == "fp32" and r["world_size"] == 1
        for name in ("tokens_per_s_per_gpu", "mfu", "step_ms", "host_step_ms", "dense_tflops"):
            assert isinstance(r[name], float) and r[name] > 0, name
        assert isinstance(r["speedup_vs_native"], float)
        assert r["layers"] == 2 and r["tokens"] == 64 and r["seq_len"] == 32
        assert r["batch_size"] == 2
        # every timed step of both rounds; every step's loss of the first round
        assert len(r["step_ms_all"]) == r["steps"] * r["rounds"] == 4
        assert all(isinstance(x, float) for x in r["step_ms_all"])
        assert len(r["losses"]) == r["warmup"] + r["steps"] == 3
        assert all(isinstance(x, float) and math.isfinite(x) for x in r["losses"])
        assert r["peak_mem_gb"] is None  # no GPU
        for name in ("gpu", "commit", "date", "torch", "triton", "transformers", "model"):
            assert isinstance(r[name], str) and r[name], name
        assert r["date"][:4].isdigit() and "T" in r["date"]
        assert r["deterministic"] is True  # both rounds from the same start: the same losses
        assert r["tokens_per_s_per_gpu"] == pytest.approx(64 / (r["step_ms"] * 1e-3))
        assert r["mfu"] == pytest.approx(
            r["flops_per_step"] / (r["step_ms"] * 1e-3) / 1e12 / r["dense_tflops"]
        )
    for r in records:
        if r["impl"] == "native":
            assert r["speedup_vs_native"] == 1.0
            assert r["experts_implementation"] == tb.NATIVE_KEY
        else:
            assert r["experts_implementation"] == "megamoe_test_reference_bf16"
    json.dumps(records)  # plain JSON


def test_losses_native_equal_megamoe_reference_step_by_step(records):
    by = {(r["model"], r["routing"], r["impl"]): r["losses"] for r in records}
    for model in ("dsv3-tiny", "qwen3-30b-a3b-tiny"):
        for routing in ("learned", "balanced"):
            native = by[(model, routing, "native")]
            ours = by[(model, routing, "megamoe-reference")]
            assert len(native) == len(ours) == 3
            for a, b in zip(native, ours):
                assert abs(a - b) <= 1e-4 * abs(a), (model, routing, native, ours)
            # the same start and data for every impl; and the model learns on the bigram data
            assert native[0] == pytest.approx(math.log(512), rel=0.05)


def test_cli_writes_a_record_file(tmp_path, capsys):
    out = tmp_path / "train.json"
    argv = ["train-bench", "--model", "qwen3-30b-a3b", "--routing", "balanced", "--rounds", "1"]
    assert cli.main([*argv, "--steps", "2", "--out", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["model"], r["impl"], r["routing"]) for r in recs] == [
        ("qwen3-30b-a3b-tiny", "native", "balanced"),
        ("qwen3-30b-a3b-tiny", "megamoe-reference", "balanced"),
    ]
    assert all(r["status"] == "ok" and r["deterministic"] is None for r in recs)
    text = capsys.readouterr().out
    assert "tokens/s/GPU" in text and "megamoe-reference" in text and str(out) in text


def test_default_out_path():
    path = tb.default_out_path("NVIDIA H200", "abc1234", "2026-12-02T01:02:03+00:00")
    assert path.endswith("benchmarks/results/train_h200_abc1234_2026-12-02.json")
    cpu = tb.default_out_path("cpu (x86_64, 2 cores)", "unknown", "2026-12-02T01:02:03+00:00")
    assert cpu.endswith("train_cpu_unknown_2026-12-02.json")


# -------------------------------------------------------------------------------------- FLOPs


def test_flops_per_step_against_a_hand_count():
    opts = _opts(tiny=True)
    for name in ("qwen3-30b-a3b-tiny", "dsv3-tiny"):
        spec = tb.MODELS[name]
        model = tb.build_model(spec, 2, opts)
        counts = tb.count_params(model)
        H, I, E, K, V, L = 64, 32, 8, 2, 512, 2
        if name == "qwen3-30b-a3b-tiny":
            heads, kv, hd = 4, 2, 16
            attn = H * heads * hd + 2 * H * kv * hd + heads * hd * H  # q, k, v, o
            shared = 0
            d_qk = d_v = hd
        else:
            heads, q_lora, kv_lora, nope, rope, v = 4, 32, 16, 16, 8, 16
            attn = (
                H * q_lora  # q_a_proj
                + q_lora * heads * (nope + rope)  # q_b_proj
                + H * (kv_lora + rope)  # kv_a_proj_with_mqa
                + kv_lora * heads * (nope + v)  # kv_b_proj
                + heads * v * H  # o_proj
            )
            shared = 3 * H * I  # one shared expert of I
            d_qk, d_v = nope + rope, v
        router = E * H
        routed_active = K * 3 * H * I  # top_k of the E experts' gate, up and down
        active = L * (attn + router + routed_active + shared) + V * H  # + LM head
        assert counts.active == active, name
        assert counts.embedding == V * H
        assert counts.routed == L * E * 3 * H * I
        batch, seq = 2, 32
        attention = 3 * L * batch * heads * seq**2 * (d_qk + d_v)  # causal, fwd + bwd
        expected = 6 * active * batch * seq + attention
        assert tb.flops_per_step(counts.active, spec, L, batch, seq) == expected
        # the meta model counts the same as the built one
        meta = tb.count_params(tb._meta_model(spec, 2, V, seq, torch.float32))
        assert meta.total == counts.total and meta.active == counts.active


def test_memory_estimate_fits_the_budget():
    spec = tb.MODELS["dsv3"]
    per_layer, fixed = tb.layer_params(spec, 32768, 4096, torch.bfloat16)
    # one DeepSeek-V3 layer with 32 experts: MLA ~187 M, experts 32 x 3 x 7168 x 2048
    assert 1.6e9 < per_layer < 1.7e9
    assert fixed == 2 * 32768 * 7168 + 7168  # embedding, LM head, final norm
    budget = 100e9
    est = tb.fit_layers(spec, budget, 4096, per_layer, fixed)
    assert est.total_bytes <= budget
    more = tb.estimate_memory(spec, est.layers + 1, 4096, per_layer, fixed)
    assert more.total_bytes > budget
    # weights + grads + two AdamW moments, 2 bytes each
    assert est.state_bytes == 8 * (est.layers * per_layer + fixed)
    assert "layers" in est.describe()
    # gradient accumulation: the earlier micro-batches' gradients are held at every backward
    one = tb.estimate_memory(spec, 9, 4096, per_layer, fixed)
    acc = tb.estimate_memory(spec, 9, 4096, per_layer, fixed, microbatches=4)
    params = 9 * per_layer + fixed
    backward_one = params * 2 * 3 + one.activation_bytes
    assert acc.total_bytes - one.total_bytes == pytest.approx(
        max(backward_one + 2 * params, one.state_bytes) - max(backward_one, one.state_bytes)
    )
    assert acc.total_bytes > one.total_bytes
    assert tb.fit_layers(spec, 130e9, 4096, per_layer, fixed, microbatches=4).layers < (
        tb.fit_layers(spec, 130e9, 4096, per_layer, fixed).layers
    )
    # fp8: the expert weights' copies in two layouts (a byte each) until the optimizer step
    fp8 = tb.estimate_memory(spec, 9, 4096, per_layer, fixed, fp8=True)
    copies = 2 * 9 * 3 * 7168 * (32 * 2048 + 2048)  # routed and shared gate, up and down
    assert fp8.fp8_bytes == copies and fp8.total_bytes == one.total_bytes + copies
    assert "fp8 weight copies" in fp8.describe() and "fp8" not in one.describe()
    assert tb.fit_layers(spec, 80e9, 4096, per_layer, fixed, fp8=True).layers < (
        tb.fit_layers(spec, 80e9, 4096, per_layer, fixed).layers
    )


# ------------------------------------------------------------------------------------ routing


@pytest.mark.parametrize(
    "tokens,top_k,experts", [(64, 2, 8), (256, 8, 32), (96, 8, 128), (3, 4, 6)]
)
def test_balanced_ids_are_balanced_and_deterministic(tokens, top_k, experts):
    ids = tb.balanced_ids(tokens, top_k, experts)
    assert ids.shape == (tokens, top_k) and ids.dtype == torch.int64
    assert torch.equal(ids, tb.balanced_ids(tokens, top_k, experts))
    assert int(ids.min()) >= 0 and int(ids.max()) < experts
    for row in ids.tolist():  # distinct experts per token
        assert len(set(row)) == top_k
    if (tokens * top_k) % experts == 0 and (experts % top_k or tokens % experts == 0):
        counts = torch.bincount(ids.flatten(), minlength=experts)
        assert counts.tolist() == [tokens * top_k // experts] * experts


def test_balanced_ids_spread_a_token_over_the_expert_range():
    # K divides E: token t takes t, t + E/K, ...: each of W = 4 rank ranges gets K / W of it
    ids = tb.balanced_ids(32, 8, 32)
    ranks = ids // 8
    for row in ranks.tolist():
        assert sorted(row) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_install_routing_wraps_and_restores_the_router():
    spec = tb.MODELS["qwen3-30b-a3b-tiny"]
    model = tb.build_model(spec, 2, _opts(tiny=True))
    blocks = tb.moe_blocks(model)
    assert len(blocks) == 2
    gate = blocks[0].gate
    x = torch.randn(10, 64)
    _, w_learned, ids_learned = gate(x)
    assert tb.install_routing(model, "balanced") == 2
    _, w, ids = gate(x)
    assert torch.equal(ids, tb.balanced_ids(10, 2, 8))
    assert torch.equal(w, torch.full_like(w_learned, 0.5))
    assert tb.install_routing(model, "balanced") == 2  # again: still one wrapper
    assert torch.equal(gate(x)[2], ids)
    tb.install_routing(model, "learned")
    _, w2, ids2 = gate(x)
    assert torch.equal(ids2, ids_learned) and torch.equal(w2, w_learned)
    assert "forward" not in gate.__dict__
    with pytest.raises(ValueError, match="routing must be one of"):
        tb.install_routing(model, "zipf")


# -------------------------------------------------------------------------------- the order


def test_run_order_mirrors_each_round():
    assert tb.run_order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert tb.run_order(["a", "b", "c"], 3) == [
        (0, "a"),
        (0, "b"),
        (0, "c"),
        (1, "c"),
        (1, "b"),
        (1, "a"),
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        tb.run_order(["a"], 0)


def test_runs_follow_the_order_and_start_from_the_same_state(monkeypatch):
    calls = []
    real = tb.train_run

    def spy(model, batches, warmup, lr, device, **kw):
        key = model.config._experts_implementation
        first = next(model.parameters()).detach().clone()
        calls.append((key, first))
        return real(model, batches, warmup, lr, device, **kw)

    monkeypatch.setattr(tb, "train_run", spy)
    opts = _opts(models=["qwen3-30b-a3b"], routings=["learned"], steps=1, warmup=0, rounds=2)
    tb.run_train_bench(opts)
    native, ours = tb.NATIVE_KEY, "megamoe_test_reference_bf16"
    assert [k for k, _ in calls] == [native, ours, ours, native]
    for _, first in calls[1:]:  # every run starts from the built model's state
        assert torch.equal(first, calls[0][1])


def test_make_batches_are_a_bigram_chain():
    a = tb.make_batches(3, 2, 16, 100, seed=1)
    assert a.shape == (3, 2, 16) and a.dtype == torch.int64
    assert torch.equal(a, tb.make_batches(3, 2, 16, 100, seed=1))
    assert not torch.equal(a, tb.make_batches(3, 2, 16, 100, seed=2))
    succ: dict[int, set[int]] = {}
    for row in a.view(-1, 16).tolist():
        for prev, nxt in zip(row, row[1:]):
            succ.setdefault(prev, set()).add(nxt)
    assert max(len(s) for s in succ.values()) <= tb.BIGRAM_BRANCHING


def test_snapshot_restore_round_trip():
    model = tb.build_model(tb.MODELS["dsv3-tiny"], 1, _opts(tiny=True))
    state = tb.snapshot(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    tb.restore(model, state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # DeepSeek-V3's router stays in float32 (transformers >= 5.18 declares it so)
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32


# -------------------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--impls", "megamoe-bogus"], "invalid choice: 'megamoe-bogus'"),
        (["--model", "llama"], "invalid choice: 'llama'"),
        (["--routing", "zipf"], "invalid choice: 'zipf'"),
    ],
)
def test_cli_rejects_bad_names(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train-bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "choose from" in err


def test_cli_rejects_bad_values(capsys):
    assert cli.main(["train-bench", "--tokens", "100", "--seq", "32"]) == 2
    err = capsys.readouterr().err
    assert "tokens must be a positive multiple of seq_len=32" in err
    assert cli.main(["train-bench", "--steps", "0"]) == 2
    assert "steps must be >= 1" in capsys.readouterr().err


def test_options_name_the_valid_values():
    with pytest.raises(ValueError, match=r"impl must be one of \['native', 'megamoe-triton'"):
        _opts(impls=["grouped_mm"])
    with pytest.raises(ValueError, match=r"model must be one of \['dsv3', 'qwen3-30b-a3b'\]"):
        _opts(models=["mixtral"])
    with pytest.raises(ValueError, match="routing must be one of"):
        _opts(routings=["uniform"])
    with pytest.raises(ValueError, match="impl must be one of"):
        tb.experts_key("fused")
    # without a GPU: the tiny models, float32, native and megamoe-reference, 3 steps
    opts = _opts()
    assert opts.tiny and opts.precision == "fp32" and opts.steps == 3
    assert opts.models == ["dsv3-tiny", "qwen3-30b-a3b-tiny"]
    assert opts.impls == ["native", "megamoe-reference"]


def test_a_megamoe_impl_without_the_integration_is_skipped_with_the_reason(monkeypatch):
    def missing(backend, precision="bf16"):
        raise RuntimeError(f"megamoe backend {backend!r} needs megamoe.integrations.transformers")

    monkeypatch.setattr(tb, "megamoe_experts_key", missing)
    opts = _opts(models=["qwen3-30b-a3b"], routings=["learned"], steps=1, warmup=0, rounds=1)
    recs = tb.run_train_bench(opts)
    by = {r["impl"]: r for r in recs}
    assert by["native"]["status"] == "ok"
    assert by["megamoe-reference"]["status"] == "skipped"
    assert "megamoe.integrations.transformers" in by["megamoe-reference"]["note"]
    assert not tb.run_failed(recs)


# ------------------------------------------------------------------------------------- plot


def test_plot_train_records(records, tmp_path):
    pytest.importorskip("matplotlib")
    from megamoe.tools.plot import main as plot_main

    path = tmp_path / "train.json"
    path.write_text(json.dumps(records))
    out = tmp_path / "train.png"
    assert plot_main([str(path), "--out", str(out)]) == 0  # train records: the train plot
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_transformers_integration_gives_the_keys(monkeypatch):
    """megamoe.integrations.transformers (the real one, no stand-in): its keys, and a CPU run of
    megamoe-reference through it has native's losses."""
    monkeypatch.undo()  # the autouse stand-in off
    pytest.importorskip("megamoe.integrations.transformers")
    assert tb.experts_key("megamoe-reference") == "megamoe_reference"
    assert tb.experts_key("megamoe-triton") == "megamoe_triton"
    assert tb.experts_key("megamoe-auto") == "megamoe"
    opts = _opts(models=["dsv3"], routings=["balanced"], steps=2, warmup=0, rounds=1)
    by = {r["impl"]: r for r in tb.run_train_bench(opts)}
    assert by["megamoe-reference"]["experts_implementation"] == "megamoe_reference"
    for a, b in zip(by["native"]["losses"], by["megamoe-reference"]["losses"]):
        assert abs(a - b) <= 1e-4 * abs(a)


def test_megamoe_table_renders_train_records(records):
    """``megamoe table`` puts training records in the train-bench summary, beside layer ones."""
    from megamoe.tools.report import format_table

    text = format_table(records)
    assert "tokens/s/GPU" in text and "vs native" in text
    for r in records:
        assert r["impl"] in text and r["model"] in text
    assert "step_ms_all" not in text  # not the generic table of every field


# ------------------------------------------------------------ micro-batches and the breakdown


def test_microbatches_accumulate_the_gradient_of_the_whole_batch(monkeypatch):
    """Two micro-batches of one sequence each, their losses scaled by 1/2, give the step of one
    batch of both sequences (per-sequence attention, per-token routing and a mean loss). SGD in
    place of AdamW: its step is the gradient itself (AdamW's first step is about sign(grad),
    which rounding flips where a gradient is near zero)."""
    monkeypatch.setattr(
        tb, "make_optimizer", lambda model, lr, *_: torch.optim.SGD(model.parameters(), lr)
    )
    spec = tb.MODELS["qwen3-30b-a3b-tiny"]
    opts = _opts(tiny=True)
    ids = tb.make_batches(1, 2, 16, opts.vocab_size, seed=3)  # [1 step, 2 sequences, 16]
    after = []
    for batches in (ids.view(1, 2, 1, 16), ids.view(1, 1, 2, 16)):
        model = tb.build_model(spec, 1, opts, seed=5)
        res = tb.train_run(model, batches, 0, 1.0, CPU)
        after.append(([p.detach().clone() for p in model.parameters()], res.losses))
    (p_micro, loss_micro), (p_whole, loss_whole) = after
    assert loss_micro[0] == pytest.approx(loss_whole[0], rel=1e-5)
    start = tb.build_model(spec, 1, opts, seed=5)
    moved = 0
    for a, b, p0 in zip(p_micro, p_whole, start.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        moved += not torch.equal(a, p0.detach())
    assert moved > 0  # the step changed the model


def test_records_with_microbatches_and_a_breakdown():
    opts = _opts(
        models=["qwen3-30b-a3b"],
        routings=["learned"],
        steps=2,
        warmup=1,
        rounds=1,
        microbatches=2,
        breakdown=True,
    )
    recs = tb.run_train_bench(opts)
    assert [r["status"] for r in recs] == ["ok", "ok"]
    for r in recs:
        assert r["microbatches"] == 2 and r["tokens"] == 64
        assert r["tokens_per_s_per_gpu"] == pytest.approx(2 * 64 / (r["step_ms"] * 1e-3))
        parts = r["breakdown_ms"]
        assert set(parts) == {"experts", "moe_block", "attention", "optimizer", "step", "rest"}
        assert all(parts[k] > 0 for k in ("experts", "moe_block", "attention", "optimizer"))
        assert parts["moe_block"] >= parts["experts"]
        assert parts["step"] >= parts["moe_block"] + parts["attention"] + parts["optimizer"]
        assert r["host_syncs"] == {} and r["alloc_retries"] is None  # no GPU
    with pytest.raises(ValueError, match="microbatches must be >= 1, got 0"):
        _opts(microbatches=0)


def test_plot_breakdown(tmp_path):
    pytest.importorskip("matplotlib")
    from megamoe.tools.plot import main as plot_main

    opts = _opts(models=["dsv3"], routings=["learned"], steps=1, warmup=0, rounds=1)
    opts.breakdown = True
    path = tmp_path / "train.json"
    path.write_text(json.dumps(tb.run_train_bench(opts)))
    out = tmp_path / "breakdown.png"
    assert plot_main([str(path), "--out", str(out), "--x", "breakdown"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    no_parts = tmp_path / "plain.json"
    no_parts.write_text(json.dumps([dict(json.loads(path.read_text())[0], breakdown_ms=None)]))
    with pytest.raises(SystemExit):
        plot_main([str(no_parts), "--out", str(out), "--x", "breakdown"])


def test_deterministic_algorithms_hold_for_the_runs_only(monkeypatch):
    seen = []
    real = tb.train_run

    def spy(*args, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*args, **kw)

    monkeypatch.setattr(tb, "train_run", spy)
    before = torch.are_deterministic_algorithms_enabled()
    opts = _opts(
        models=["qwen3-30b-a3b"],
        routings=["learned"],
        steps=1,
        warmup=0,
        rounds=1,
        deterministic_algorithms=True,
    )
    recs = tb.run_train_bench(opts)
    assert seen == [True, True]
    assert torch.are_deterministic_algorithms_enabled() == before
    assert all(r["deterministic_algorithms"] is True for r in recs)
    opts.deterministic_algorithms = False
    assert all(r["deterministic_algorithms"] is False for r in tb.run_train_bench(opts))


def test_an_fp8_impl_records_its_precision_and_trains_close_to_bf16():
    opts = _opts(
        models=["qwen3-30b-a3b"],
        routings=["learned"],
        impls=["native", "megamoe-reference", "megamoe-reference-fp8"],
        steps=3,
        warmup=0,
        rounds=1,
    )
    by = {r["impl"]: r for r in tb.run_train_bench(opts)}
    assert by["megamoe-reference-fp8"]["status"] == "ok", by["megamoe-reference-fp8"]["note"]
    assert by["megamoe-reference-fp8"]["experts_implementation"] == "megamoe_test_reference_fp8"
    assert by["megamoe-reference-fp8"]["precision"] == "fp8"
    assert by["megamoe-reference"]["precision"] == by["native"]["precision"] == "fp32"
    bf16, fp8 = by["megamoe-reference"]["losses"], by["megamoe-reference-fp8"]["losses"]
    assert bf16 != fp8
    for a, b in zip(fp8, bf16):
        assert abs(a - b) <= 5e-3 * abs(b)
    assert tb.experts_key("native") == tb.NATIVE_KEY


def test_the_megamoe_optimizers_take_the_large_parameters_and_the_fp8_copies(monkeypatch):
    """``--optimizer megamoe``: the parameters of at least ``MEGAMOE_UPDATE_NUMEL`` elements go
    to ``megamoe.optim.AdamW`` (no copies), the rest to torch's AdamW; ``megamoe-copies`` also
    gives it the expert weights of fp8 layers with their views, and a step of both updates
    each parameter once and leaves the copies of the layer's six weights in the cache; with
    no large parameter (or with ``torch``) torch's AdamW takes them all."""
    from megamoe import optim
    from megamoe.backends import fp8_weights

    fp8_cfg = megamoe.MoEConfig(32, 32, 2, 1, shared_intermediate_size=16, precision="fp8")
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), megamoe.MoE(fp8_cfg, backend="triton", seed=0)
    )
    moe_params = list(model[1].parameters())
    assert megamoe.optim is optim  # (as the docs write it: after `import megamoe`)
    assert isinstance(tb.make_optimizer(model, 1e-2, CPU, "megamoe"), torch.optim.AdamW)
    monkeypatch.setattr(tb, "MEGAMOE_UPDATE_NUMEL", 32 * 32)  # the layer's [.., 32, 32] weights
    large = [p for p in model.parameters() if p.numel() >= 32 * 32]
    theirs, ours = tb.make_optimizer(model, 1e-2, CPU, "megamoe").optimizers
    assert isinstance(theirs, torch.optim.AdamW) and isinstance(ours, optim.AdamW)
    assert [p for g in ours.param_groups for p in g["params"]] == large
    monkeypatch.setattr(tb, "MEGAMOE_UPDATE_NUMEL", 1 << 20)
    opt = tb.make_optimizer(model, 1e-2, CPU, "megamoe-copies")
    theirs, ours = opt.optimizers
    assert [p for g in ours.param_groups for p in g["params"]] == moe_params
    assert [p for g in theirs.param_groups for p in g["params"]] == list(model[0].parameters())
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    fp8_weights.clear()
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert not torch.equal(p.detach(), b)
        assert opt.optimizers[0].state.get(p) is None or ours.state.get(p) is None
    assert len(fp8_weights.CACHE) == 6  # the update's copies of the layer's six weights
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    bf16 = torch.nn.Sequential(megamoe.MoE(megamoe.MoEConfig(32, 32, 2, 1), backend="triton"))
    assert isinstance(tb.make_optimizer(bf16, 1e-2, CPU, "megamoe-copies"), torch.optim.AdamW)
    assert isinstance(tb.make_optimizer(model, 1e-2, CPU, "torch"), torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"optimizer must be one of \['torch', 'megamoe', 'meg"):
        _opts(optimizer="sgd")

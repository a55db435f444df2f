"""megamoe.tools.step_parts on the CPU (host clocks): the marks time a module's forward and
backward, also when it is called with keywords, nested parts on their own, the optimizer, and
the rest of the step; nothing is recorded outside a step, and remove() takes the marks off."""

from __future__ import annotations

import time

import torch

from megamoe.tools import step_parts

FWD_S, BWD_S = 0.02, 0.03  # sleeps of the timed module's forward and backward


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(FWD_S)
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(BWD_S)
        return grad * 2.0


class SlowLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, hidden_states):
        return _Slow.apply(self.lin(hidden_states))


class Block(torch.nn.Module):
    """A layer with an ``experts`` inside its MoE block and a ``self_attn`` called by keyword."""

    def __init__(self):
        super().__init__()
        self.self_attn = SlowLinear()
        self.mlp = torch.nn.Module()
        self.mlp.experts = SlowLinear()
        self.mlp.forward = lambda h: self.mlp.experts(h) + 1.0

    def forward(self, h):
        h = h + self.self_attn(hidden_states=h)
        return h + self.mlp(h)


def _model(layers: int = 2) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block() for _ in range(layers)))


def _step(model, marks, opt, x):
    marks.begin_step()
    model(x).sum().backward()
    marks.optimizer_start()
    time.sleep(0.01)
    opt.step()
    marks.optimizer_end()
    marks.end_step()


def test_parts_time_forward_and_backward_of_every_call():
    model = _model(layers=2)
    parts = {
        "experts": [b.mlp.experts for b in model],
        "moe_block": [b.mlp for b in model],
        "attention": [b.self_attn for b in model],
    }
    marks = step_parts.PartMarks(parts, cuda=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(3):  # (the median: the first optimizer step is slower)
        _step(model, marks, opt, x)
    got = marks.summary(("moe_block", "attention"))
    per_module = 1e3 * (FWD_S + BWD_S)  # ms of one call's forward + backward
    for name in ("experts", "moe_block", "attention"):  # two calls of each per step
        assert 2 * per_module <= got[name] < 2 * per_module + 40, (name, got)
    assert got["moe_block"] >= got["experts"]  # nests the experts
    assert 10 <= got["optimizer"] < 40, got
    # the top-level parts do not overlap, in any step (the medians of separate columns need
    # not add up: they may come from different steps, far apart on a loaded machine)
    for s in marks._steps:
        p = marks.step_parts_ms(s)
        assert p["step"] - p["optimizer"] - p["moe_block"] - p["attention"] >= -1.0, p
    assert got["rest"] >= -1.0
    assert got["step"] >= 4 * per_module


def test_no_marks_outside_a_step_and_remove_takes_them_off():
    model = _model(layers=1)
    marks = step_parts.PartMarks({"attention": [model[0].self_attn]}, cuda=False)
    x = torch.randn(2, 8, requires_grad=True)
    y = model[0].self_attn(hidden_states=x)  # not in a step: no mark node in the graph
    assert type(y.grad_fn).__name__ != "_MarkBackward"
    assert marks.summary(()) == {}
    marks.begin_step()
    y = model[0].self_attn(hidden_states=x)
    assert type(y.grad_fn).__name__ == "_MarkBackward"
    y.sum().backward()
    marks.end_step()
    assert marks.summary(())["attention"] >= 1e3 * (FWD_S + BWD_S)
    marks.remove()
    marks.begin_step()
    y = model[0].self_attn(hidden_states=x)
    assert type(y.grad_fn).__name__ != "_MarkBackward"


def test_marks_change_no_value_or_gradient():
    model = _model(layers=2)
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()
    want = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    marks = step_parts.PartMarks({"attention": [b.self_attn for b in model]}, cuda=False)
    marks.begin_step()
    model(x).sum().backward()
    marks.end_step()
    got = [p.grad for p in model.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_find_parts_of_a_decoder():
    model = _model(layers=3)
    parts = step_parts.find_parts(model, [b.mlp for b in model])
    assert parts["experts"] == [b.mlp.experts for b in model]
    assert parts["moe_block"] == [b.mlp for b in model]
    assert parts["attention"] == [b.self_attn for b in model]


def test_sync_sites_on_the_cpu_runs_the_step_and_finds_none():
    ran = []
    assert step_parts.sync_sites(lambda: ran.append(1)) == {}
    assert ran == [1]

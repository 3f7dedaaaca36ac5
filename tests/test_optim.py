"""AccumAdam: exactly Adam/AdamW at tau=1, moments that move every tau steps, a faithful state_dict."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.optim import AccumAdam, AccumAdamW


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def set_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * (1 + step % 3)


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        (AccumAdam, torch.optim.Adam, {}),
        (AccumAdam, torch.optim.Adam, {"weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-6}),
        (AccumAdamW, torch.optim.AdamW, {"weight_decay": 0.05}),
    ],
)
def test_with_one_accumulation_step_it_is_torch_adam_step_for_step(ours, theirs, kwargs):
    a, b = make_params(), make_params()
    opt_a, opt_b = ours(a, lr=0.01, accum_steps=1, **kwargs), theirs(b, lr=0.01, **kwargs)
    for step in range(25):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=f"step {step}")


def test_moments_change_only_every_tau_steps_while_parameters_move_every_step():
    params = make_params()
    tau = 3
    opt = AccumAdam(params, lr=0.01, accum_steps=tau)
    set_grads(params, 0)
    opt.step()
    state = opt.state[params[0]]
    moments = (state["exp_avg"].clone(), state["exp_avg_sq"].clone())
    assert torch.count_nonzero(moments[0]) == 0, "the first tau-1 steps leave m at zero"
    grads = []
    for step in range(1, 4 * tau):
        before = params[0].detach().clone()
        set_grads(params, step)
        grads.append(params[0].grad.clone())
        opt.step()
        assert not torch.equal(params[0], before), f"parameters must move at step {step + 1}"
        now = (state["exp_avg"].clone(), state["exp_avg_sq"].clone())
        changed = not torch.equal(now[0], moments[0]) and not torch.equal(now[1], moments[1])
        assert changed == ((step + 1) % tau == 0), f"step {step + 1}: moments changed={changed}"
        moments = now
    # after the second window, m is b1 * m1 + (1 - b1) * mean gradient of steps 4..6
    opt2 = AccumAdam(make_params(), lr=0.01, accum_steps=tau)
    p = opt2.param_groups[0]["params"][0]
    window_means = []
    for step in range(2 * tau):
        set_grads(opt2.param_groups[0]["params"], step)
        opt2.step()
        if (step + 1) % tau == 0:
            window_means.append(torch.stack([_grad_of(step - i) for i in range(tau)]).mean(0))
    m1 = 0.1 * window_means[0]
    torch.testing.assert_close(opt2.state[p]["exp_avg"], 0.9 * m1 + 0.1 * window_means[1])


def _grad_of(step: int) -> torch.Tensor:
    params = make_params()
    set_grads(params, step)
    return params[0].grad


@pytest.mark.parametrize("tau", [1, 4])
def test_state_dict_round_trip_continues_identically(tau):
    a = make_params()
    opt_a = AccumAdamW(a, lr=0.02, accum_steps=tau)
    for step in range(6):  # mid-window for tau=4: the accumulated gradient must survive too
        set_grads(a, step)
        opt_a.step()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = AccumAdamW(b, lr=0.5, accum_steps=1)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert opt_b.param_groups[0]["accum_steps"] == tau and opt_b.param_groups[0]["lr"] == 0.02
    for step in range(6, 15):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb)


def test_lr_schedulers_drive_it_like_any_torch_optimizer():
    params = make_params()
    opt = AccumAdam(params, lr=0.1, accum_steps=2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(4):
        set_grads(params, step)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"accum_steps": 0}, "accum_steps=0 is invalid"),
        ({"accum_steps": 2.5}, "accum_steps=2.5 is invalid"),
        ({"lr": -1.0}, "lr=-1.0 is invalid"),
        ({"betas": (0.9, 1.0)}, r"betas=\(0.9, 1.0\) is invalid"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 is invalid"),
    ],
)
def test_invalid_options_are_rejected(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        AccumAdam(make_params(), **kwargs)

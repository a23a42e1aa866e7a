"""The update overhead cuts (PPO's, issue 31; DQN's, SAC's and TD3's, issue 28) compute the same numbers, bit for
bit, as the forms they replace: all epochs' shuffles at once against one epoch at a time, the fused Adam kernel
called directly against optimizer.step() (also on a plain tensor, as SAC's temperature), the shared gradient clipping
(clip_grad_norm of optimizer_step.py: PPO's, DQN's) vs torch's, an optimizer built without importing torch._dynamo, and
the trainer's learn flushing denormal floats (its Adam steps on decayed moments) and nothing else."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
from harness.runs import TINY, assert_run_complete, run_main
from torch import nn

from spmd_rl.algorithms.optimizer_step import FusedAdamStep, clip_grad_norm
from spmd_rl.algorithms.ppo import epoch_minibatches, shuffled_minibatches
from spmd_rl.roles.trainer import FlushDenormals, flushing_denormals


def batch(size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(size)
    valid = torch.rand(size, generator=generator) > 0.3
    valid[: size // 3] = False  # minibatches with few or no valid entries
    data = {"obs": torch.randn(size, 4, generator=generator), "valid": valid}
    for key in ("log_prob", "advantage", "return_", "value"):
        data[key] = torch.where(valid, torch.randn(size, generator=generator), 0.0)
    return data


@pytest.mark.parametrize("size, parts, epochs", [(256, 2, 20), (67, 4, 3), (5, 5, 2)])
def test_all_epochs_at_once_equal_one_epoch_at_a_time_bit_for_bit(size, parts, epochs):
    data = batch(size)
    torch.manual_seed(3)
    together = shuffled_minibatches(data, parts, normalize=True, epochs=epochs)
    after_together = torch.rand(4)  # the random numbers drawn after the update
    torch.manual_seed(3)
    one_by_one = [list(epoch_minibatches(data, parts, normalize=True)) for _ in range(epochs)]
    assert torch.equal(after_together, torch.rand(4))
    assert len(together) == epochs
    for epoch, expected_epoch in zip(together, one_by_one):
        assert len(epoch) == len(expected_epoch) == parts
        for (part, share, advantage), (expected, expected_share, expected_advantage) in zip(epoch, expected_epoch):
            assert torch.equal(share, expected_share) and torch.equal(advantage, expected_advantage)
            assert part.keys() == expected.keys()
            assert all(torch.equal(part[key], expected[key]) for key in part)


def adam_pair(**options) -> tuple[list[nn.Parameter], list[nn.Parameter], torch.optim.Adam, torch.optim.Adam]:
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(shape)) for shape in ((2, 4, 8), (2, 1, 8), (3,))]
    reference = [nn.Parameter(p.detach().clone()) for p in mine]
    options = dict(lr=1e-3, eps=1e-5, fused=True, **options)
    return mine, reference, torch.optim.Adam(mine, **options), torch.optim.Adam(reference, **options)


def test_fused_adam_step_equals_optimizer_step_bit_for_bit_and_skips_it():
    mine, reference, optimizer, reference_optimizer = adam_pair()
    step = FusedAdamStep(optimizer)
    for index in range(5):
        grads = [torch.randn_like(p) for p in mine]
        for params in (mine, reference):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
        optimizer.param_groups[0]["lr"] = reference_optimizer.param_groups[0]["lr"] = 1e-3 * (1 - index / 5)
        step()
        reference_optimizer.step()
        assert step.state_lists is not None  # the kernel was called directly, not through optimizer.step()
        assert all(torch.equal(p, q) for p, q in zip(mine, reference))
    state, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    for index, values in expected["state"].items():
        assert values.keys() == state["state"][index].keys()
        assert all(torch.equal(state["state"][index][key], value) for key, value in values.items())


def test_fused_adam_step_steps_the_state_a_checkpoint_loaded():
    # A resume loads the optimizer's state after the stepper has read the old one's tensors: it must step the new.
    mine, reference, optimizer, reference_optimizer = adam_pair()
    step = FusedAdamStep(optimizer)

    def one_step():
        grads = [torch.randn_like(p) for p in mine]
        for params in (mine, reference):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
        step()
        reference_optimizer.step()

    for _ in range(3):
        one_step()
    saved = copy.deepcopy(reference_optimizer.state_dict())  # a state_dict's tensors are the live ones
    one_step()
    optimizer.load_state_dict(copy.deepcopy(saved))  # back one step, as a resume from the 3-step checkpoint
    reference_optimizer.load_state_dict(copy.deepcopy(saved))
    with torch.no_grad():
        for param, other in zip(mine, reference):
            param.copy_(other)
    for _ in range(2):
        one_step()
        assert step.state_lists is not None
        assert all(torch.equal(p, q) for p, q in zip(mine, reference))
    assert all(
        torch.equal(optimizer.state[p][key], reference_optimizer.state[q][key])
        for p, q in zip(mine, reference)
        for key in ("step", "exp_avg", "exp_avg_sq")
    )


def test_fused_adam_step_on_a_plain_tensor_calls_the_kernel_and_equals_optimizer_step():
    torch.manual_seed(0)
    mine = torch.randn((), requires_grad=True)  # a log temperature: a leaf tensor, not an nn.Parameter
    reference = mine.detach().clone().requires_grad_(True)
    optimizer, reference_optimizer = (torch.optim.Adam([t], lr=3e-4, fused=True) for t in (mine, reference))
    step = FusedAdamStep(optimizer)
    for _ in range(4):
        grad = torch.randn(())
        mine.grad, reference.grad = grad.clone(), grad.clone()
        step()
        reference_optimizer.step()
        assert step.state_lists is not None
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("max_norm", [10.0, 0.01])  # not clipping, and clipping
def test_gradient_clipping_equals_torch_clip_grad_norm_bit_for_bit(max_norm):
    torch.manual_seed(1)
    mine = [nn.Parameter(torch.randn(shape)) for shape in ((256, 4), (256,), (2, 256))]
    reference = [nn.Parameter(p.detach().clone()) for p in mine]
    for param, other in zip(mine, reference):
        param.grad = torch.randn_like(param) * 0.3
        other.grad = param.grad.clone()
    before = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in mine]))
    clip_grad_norm(mine, max_norm)
    torch.nn.utils.clip_grad_norm_(reference, max_norm)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(mine, reference))
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in mine]))
    assert torch.isclose(after, min(before, torch.tensor(max_norm)), rtol=1e-4)  # clipped only above max_norm


def test_fused_adam_step_leaves_what_it_does_not_cover_to_optimizer_step():
    mine, reference, optimizer, reference_optimizer = adam_pair(amsgrad=True)
    step = FusedAdamStep(optimizer)
    for params in (mine, reference):
        for param in params:
            param.grad = torch.ones_like(param)
    step()
    reference_optimizer.step()
    assert step.state_lists is None
    assert all(torch.equal(p, q) for p, q in zip(mine, reference))


def test_an_optimizer_is_built_saved_and_loaded_without_importing_torch_dynamo():
    code = (
        "import sys, torch\n"
        "from spmd_rl.runtime.fast_imports import optimizers_without_dynamo\n"
        "optimizers_without_dynamo()\n"
        "from spmd_rl.algorithms.optimizer_step import FusedAdamStep\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "optimizer = torch.optim.Adam([p], fused=True)\n"
        "p.grad = torch.ones(3)\n"
        "FusedAdamStep(optimizer)()\n"
        "optimizer.zero_grad()\n"
        "optimizer.load_state_dict(optimizer.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_flush_denormals_flushes_inside_restores_after_and_leaves_a_flushing_thread_alone():
    assert not flushing_denormals()
    moment = torch.full((4,), 2e-38)
    with FlushDenormals():
        assert flushing_denormals()
        assert not (moment * 0.5).any()  # 1e-38 is a denormal: flushed to 0
    assert not flushing_denormals() and (moment * 0.5).all()
    torch.set_flush_denormal(True)
    try:
        with FlushDenormals():
            assert flushing_denormals()
        assert flushing_denormals()  # it was on before: left on
    finally:
        torch.set_flush_denormal(False)


def test_the_algorithms_learn_runs_flushed_and_acting_does_not(tmp_path):
    """A plug-in PPO reports, from its learn and from its policy's act, whether denormals flush there."""
    plugins = "tests.harness.probe_plugins"
    probe = [f"algo.class={plugins}:FlushProbePPO", f"policy.class={plugins}:FlushProbePolicy"]
    result = run_main("--config", TINY, f"run.dir={tmp_path}", *probe)
    records = assert_run_complete(result, tmp_path, iterations=8)
    assert [(r["learn_flushed"], r["act_flushed"]) for r in records] == [(1.0, 0.0)] * 8

"""spawn_ranks: results by rank, and failures reported as soon as they are known, with nothing left running."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from sdc_telemetry.testing import RankFailed, emulate_gpu_numerics, spawn_ranks

TIMEOUT = 120.0  # far longer than any of these runs: a failure reported "within 120s" means it waited for it


def _echo(rank: int, world: int, tag: str) -> tuple[int, int, str, str]:
    return rank, world, tag, os.environ.get("SDC_TEST_TAG", "")


def _rank1_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    time.sleep(600)


def _rank1_exits(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()
    time.sleep(600)


def _rank1_skips_the_collective(rank: int, world: int) -> None:
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    time.sleep(600)


def _sleeps(rank: int, world: int) -> None:
    time.sleep(600)


def _failure(fn: object, world: int = 2, **kw: object) -> str:
    kw.setdefault("timeout", TIMEOUT)
    with pytest.raises(RankFailed) as info:
        spawn_ranks(fn, world, **kw)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []
    return str(info.value)


def test_results_come_back_ordered_by_rank_with_the_environment_applied() -> None:
    """Each rank's return value comes back at its rank's index; env and rank_env reach the rank's process."""
    out = spawn_ranks(_echo, 2, ("x",), timeout=TIMEOUT, rank_env=lambda r: {"SDC_TEST_TAG": f"t{r}"})
    assert out == [(0, 2, "x", "t0"), (1, 2, "x", "t1")]
    assert multiprocessing.active_children() == []


def test_a_rank_that_raises_is_reported_with_its_error_and_the_hung_rank_is_killed() -> None:
    """The raising rank's error and traceback are reported, not a timeout; the rank still running is killed."""
    msg = _failure(_rank1_raises)
    assert "rank 1: ValueError: boom from rank 1" in msg and "Traceback" in msg
    assert "rank 0: no result" in msg and "killed" in msg
    assert "did not finish within" not in msg


def test_a_rank_that_dies_is_reported_with_its_exit_code() -> None:
    """A rank that exits without a result (os._exit(3)) is reported with exit code 3, not as a timeout."""
    msg = _failure(_rank1_exits)
    assert "rank 1: died without a result, exit code 3" in msg
    assert "rank 0:" in msg
    assert "did not finish within" not in msg


def test_a_collective_that_a_rank_never_joins_fails_within_pg_timeout() -> None:
    """pg_timeout reaches the process group: the waiting rank's collective raises a timeout of its own."""
    msg = _failure(_rank1_skips_the_collective, pg_timeout=2.0)
    rank0 = next(line for line in msg.splitlines() if line.startswith("rank 0:"))
    assert "timed out" in msg.lower() and "Error" in rank0
    assert "did not finish within" not in msg


def test_a_hung_run_ends_at_the_timeout_and_is_killed() -> None:
    """A rank still running at ``timeout`` is reported as such and killed."""
    msg = _failure(_sleeps, world=1, timeout=3.0)
    assert "ranks [0] did not finish within 3s" in msg and "rank 0: still running at the timeout: killed" in msg


def test_bad_arguments_are_refused_before_spawning() -> None:
    """world < 1 and non-positive timeouts raise ValueError naming the argument."""
    with pytest.raises(ValueError, match="world"):
        spawn_ranks(_echo, 0)
    with pytest.raises(ValueError, match="pg_timeout"):
        spawn_ranks(_echo, 1, pg_timeout=0)


# -- emulate_gpu_numerics -------------------------------------------------------------------------------------------


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two outputs as a whole (norm of the difference over the norm)."""
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def _elementwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


class _Wrapper(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)  # type: ignore[no-any-return]


def test_reruns_of_the_same_input_differ_by_about_the_noise() -> None:
    """With noise=1e-6 two forward passes of the same input differ (fresh noise on every call) by about 1e-6
    relative, each element of a hooked layer's output by at most 2e-6; the global RNG is never drawn."""
    net, x = _net(), torch.randn(64, 16)
    clean = net(x).detach()
    handle = emulate_gpu_numerics(net, noise=1e-6, seed=3)
    assert handle.modules == ["0", "2"]  # the two Linears: the submodules holding parameters of their own
    state = torch.get_rng_state()
    a, b = net(x).detach(), net(x).detach()
    assert torch.equal(torch.get_rng_state(), state)  # dropout masks and a replay's restored RNG are untouched
    assert handle.calls == 4
    assert 1e-7 < _rel(a, b) < 1e-5 and 1e-7 < _rel(a, clean) < 1e-5
    handle.remove()
    hidden = net[1](net[0](x)).detach()
    with emulate_gpu_numerics(net, noise=1e-6, seed=3, modules=["2"]):
        one, two = net[2](hidden).detach(), net[2](hidden).detach()
    assert 1e-7 < _elementwise(one, two) <= 2.1e-6


def test_a_kernel_deviation_is_self_consistent_and_differs_from_the_others() -> None:
    """bias=1e-5 without noise: the same input gives bitwise the same output on every call (a deterministic
    kernel), about 1e-5 relative away from the unperturbed model's and from another seed's; gradients flow."""
    net, x = _net(), torch.randn(64, 16)
    clean = net(x).detach()
    with emulate_gpu_numerics(net, noise=0.0, bias=1e-5, seed=7) as handle:
        out = net(x)
        again = net(x).detach()
        assert torch.equal(out.detach(), again)
        assert 1e-6 < _rel(again, clean) < 1e-4
        out.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    assert not handle.active
    other = _net()
    with emulate_gpu_numerics(other, noise=0.0, bias=1e-5, seed=8):  # another rank's kernel choice
        assert 1e-6 < _rel(other(x).detach(), again) < 1e-4


def test_dithered_bf16_outputs_keep_changes_below_half_a_unit_in_the_last_place() -> None:
    """bf16: a change of 1e-3 relative (under half a unit in the last place, 2e-3 to 4e-3) rounds back to the same
    bits to nearest; dithered, some elements move by one unit and the mean change is the exact one (a difference
    inside a float32 accumulation before rounding). A factor of 1 never changes a bit; float32 is rounded to nearest
    either way. emulate_gpu_numerics(dither=True): a deviating kernel then changes bf16 outputs, deterministically."""
    from sdc_telemetry.faults import scaled

    x = torch.randn(200_000, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(scaled(x, 1 + 1e-3), x)
    moved = scaled(x, 1 + 1e-3, torch.Generator().manual_seed(2))
    changed = moved != x
    assert 0.05 < float(changed.float().mean()) < 0.5
    steps = (moved.float() - x.float()).abs()[changed] / x.float().abs()[changed]
    assert float(steps.max()) <= 2 ** -7 + 1e-9  # one unit in the last place at most
    assert abs(float(((moved.float() - x.float()) / x.float()).mean()) - 1e-3) < 1e-4
    assert torch.equal(scaled(x, 1.0, torch.Generator().manual_seed(3)), x)
    y = torch.randn(1000)
    assert torch.equal(scaled(y, 1.5, torch.Generator()), y * 1.5)
    net, inp = _net().bfloat16(), torch.randn(64, 16).bfloat16()
    clean = net(inp).detach()
    with emulate_gpu_numerics(net, noise=0.0, bias=1e-5, seed=7):
        assert torch.equal(net(inp).detach(), clean)  # 1e-5 rounds away to nearest
    with emulate_gpu_numerics(net, noise=0.0, bias=1e-5, seed=7, dither=True):
        a, b = net(inp).detach(), net(inp).detach()
    assert not torch.equal(a, clean) and torch.equal(a, b)  # the deviating kernel shows, and stays the same


def test_removal_restores_exact_outputs_and_parameters_are_never_touched() -> None:
    """After remove() outputs are bitwise the unperturbed ones again; perturbed forward passes leave the
    parameters (what the monitor fingerprints) bitwise unchanged; a wrapper with .module is unwrapped."""
    net, x = _net(), torch.randn(8, 16)
    clean = net(x).detach()
    params = [p.detach().clone() for p in net.parameters()]
    wrapped = _Wrapper(net)
    handle = emulate_gpu_numerics(wrapped, noise=1e-6, bias=1e-5)
    assert handle.modules == ["0", "2"]
    assert not torch.equal(wrapped(x).detach(), clean)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), params, strict=True))
    handle.remove()
    handle.remove()  # a second call does nothing
    assert torch.equal(wrapped(x).detach(), clean) and handle.calls == 2


def test_bad_arguments_name_the_problem() -> None:
    """Negative or huge noise, a non-finite bias, an unknown submodule and a non-module are refused clearly."""
    net = _net()
    with pytest.raises(ValueError, match="noise"):
        emulate_gpu_numerics(net, noise=-1e-6)
    with pytest.raises(ValueError, match="noise"):
        emulate_gpu_numerics(net, noise=0.7)
    with pytest.raises(ValueError, match="bias"):
        emulate_gpu_numerics(net, bias=float("nan"))
    with pytest.raises(ValueError, match="no submodule named 'fc9'"):
        emulate_gpu_numerics(net, modules=["fc9"])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        emulate_gpu_numerics("net")  # type: ignore[arg-type]

"""Bad input to the monitor gets a clear error (single process; a one-rank gloo group where one is needed)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sdc_telemetry as sdc

OFF = {"metrics_port": None, "nvml": False}


def _loss(m: nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).sum()


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_model_must_be_a_module_and_keywords_are_checked() -> None:
    """Not a module, a bad start_step or a misspelt keyword: clear errors naming the problem."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        sdc.SDCMonitor(lambda x: x, opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_step"):
        sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF), start_step=-1)
    with pytest.raises(TypeError, match="start_stp"):
        sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF), start_stp=3)  # type: ignore[call-arg]


def test_plain_module_in_one_process_checks_gradients(caplog: pytest.LogCaptureFixture) -> None:
    """No process group: the same three lines work; a NaN gradient is reported at its (resumed) step."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="sdc_telemetry"):
        mon = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF), start_step=7)
    assert "monitoring 1 rank" in caplog.text and "the weight vote need several ranks" in caplog.text
    for k in range(3):
        x = torch.ones(3, 4)
        with mon.step(x) as step:
            step.backward(model(x).sum() * (math.nan if k == 1 else 1.0))
        opt.step()
        opt.zero_grad()
    assert [(i.step, i.check, i.suspect_ranks) for i in mon.incidents] == [(8, "grad_local", (0,))]
    mon.close()


def test_needs_an_initialised_process_group(tmp_path: Path) -> None:
    """Without init_process_group the error says to call it."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 's'}", rank=0, world_size=1)
    ddp = DistributedDataParallel(nn.Linear(2, 2))
    dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        sdc.SDCMonitor(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))


def test_world_of_one_disables_comparisons_with_a_warning(one_rank: None, caplog: pytest.LogCaptureFixture) -> None:
    """One rank: weight and replay checks off (warned), gradient checks still catch a NaN."""
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with caplog.at_level(logging.INFO, logger="sdc_telemetry"):
        mon = sdc.SDCMonitor(ddp, opt, loss_fn=_loss, config=sdc.SDCConfig(replay_every=5, **OFF))
    assert "one replica" in caplog.text
    x = torch.ones(3, 4)
    with mon.step(x) as step:
        step.backward(ddp(x).sum() * float("nan"))
    opt.step()
    assert [i.check for i in mon.incidents] == ["grad_local"]
    assert mon.verify_weights() is None
    mon.close()
    mon.close()  # a second close is harmless


def test_one_rank_needs_no_loss_fn(one_rank: None) -> None:
    """With one replica there is no replay, so the default replay_every needs no loss_fn (the line says so)."""
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    mon = sdc.SDCMonitor(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), config=sdc.SDCConfig(replay_every=10, **OFF))
    assert mon.verify_weights() is None
    mon.close()


def test_backward_outside_step_and_bad_loss(one_rank: None) -> None:
    """step.backward() after the with-block, or with a non-scalar loss, raises a clear error."""
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = sdc.SDCMonitor(ddp, opt, config=sdc.SDCConfig(replay_every=0, **OFF))
    x = torch.ones(3, 4)
    with mon.step(x) as step:
        with pytest.raises(ValueError, match="scalar"):
            step.backward(ddp(x))
        step.backward(ddp(x).sum())
    with pytest.raises(RuntimeError, match="outside"):
        step.backward(ddp(x).sum())
    mon.close()


def test_existing_comm_hook_gets_a_how_to(one_rank: None) -> None:
    """A model that already has a comm hook: the error says to pass it as comm_hook=."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(nn.Linear(4, 2))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    with pytest.raises(ValueError, match="comm_hook="):
        sdc.SDCMonitor(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), config=sdc.SDCConfig(replay_every=0, **OFF))


def test_config_must_be_sdcconfig(one_rank: None) -> None:
    """A dict instead of SDCConfig is refused."""
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    with pytest.raises(TypeError, match="SDCConfig"):
        sdc.SDCMonitor(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), config={"replay_every": 0})  # type: ignore[arg-type]


def test_close_on_an_exception_path_runs_no_collective_and_keeps_the_original_error(
        one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that fails with a verdict still in flight: close() decides nothing, runs no collective, and the
    original error is what propagates."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = sdc.SDCMonitor(ddp, opt, config=sdc.SDCConfig(replay_every=0, verdicts="deferred", **OFF))
    with monitor.step() as step:
        step.backward(ddp(torch.ones(3, 4)).sum())
    assert monitor._pending is not None  # a verdict is in flight: a normal close() would decide it (collective)
    calls: list[str] = []
    for name in ("all_reduce", "all_gather_into_tensor", "all_gather_object"):
        monkeypatch.setattr(dist, name, lambda *a, _n=name, **k: calls.append(_n))
    with pytest.raises(KeyError, match="data loader"):
        with monitor:
            raise KeyError("data loader")
    assert monitor.closed and calls == []


def test_close_after_sdc_detected_runs_no_collective(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """After SDCDetected stopped the loop, close() returns at once without a collective the others never join."""
    net = nn.Linear(4, 2)
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = sdc.SDCMonitor(ddp, opt, config=sdc.SDCConfig(replay_every=0, on_suspect="raise", verdicts="deferred",
                                                            **OFF))
    with monitor.step() as step:  # healthy: its verdict stays in flight
        step.backward(ddp(torch.ones(3, 4)).sum())
    with pytest.raises(sdc.SDCDetected) as raised:
        with monitor.step() as step:  # an audit-free step whose NaN names this process (decided at once below)
            step.backward(ddp(torch.full((3, 4), math.nan)).sum())
        monitor.verify_weights()  # not reached when the deferred verdict raised
        monitor._settle()
    assert raised.value.incident.check == "grad_local"
    calls: list[str] = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    monitor.close()
    assert monitor.closed and calls == []


def test_setup_agreement_ignores_deployment_fields(one_rank: None) -> None:
    """Only detection settings enter the set-up hash: OTLP endpoint, metrics host and job name may differ by node."""
    from sdc_telemetry.core.setup import detection_hash

    base = sdc.SDCConfig(**OFF)
    node = sdc.SDCConfig(otlp_endpoint="http://10.0.0.7:4318", metrics_host="127.0.0.1", job_name="other", **OFF)
    assert detection_hash(base, 0) == detection_hash(node, 0)
    assert detection_hash(base, 0) != detection_hash(sdc.SDCConfig(weights_every=2, **OFF), 0)
    assert detection_hash(base, 0) != detection_hash(base, 1)
    assert detection_hash(base, 0) != detection_hash(sdc.SDCConfig(verdicts="deferred", **OFF), 0)


@pytest.mark.parametrize("verdicts", ["immediate", "deferred"])
def test_step_finite_is_the_guard_against_a_non_finite_update(verdicts: str) -> None:
    """`if step.finite: optimizer.step()`: a finite step says True, a NaN step False (read after the block, on either
    verdict path), so the NaN never reaches the weights; reading it inside the block is refused."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = sdc.SDCMonitor(net, opt, config=sdc.SDCConfig(verdicts=verdicts, **OFF))
    seen = []
    for x in (torch.ones(3, 4), torch.full((3, 4), math.nan), torch.ones(3, 4)):
        with monitor.step(x) as step:
            with pytest.raises(RuntimeError, match="after the step"):
                step.finite  # noqa: B018 - the property is the call under test
            step.backward(net(x).sum())
        seen.append(step.finite)
        if step.finite:
            opt.step()
        opt.zero_grad()
    monitor.close()
    assert seen == [True, False, True]
    assert all(bool(torch.isfinite(p).all()) for p in net.parameters())
    with pytest.raises(RuntimeError, match="grad_checks"):
        off = sdc.SDCMonitor(net, opt, config=sdc.SDCConfig(grad_checks=False, **OFF))
        with off.step(torch.ones(3, 4)) as step:
            step.backward(net(torch.ones(3, 4)).sum())
        try:
            step.finite  # noqa: B018
        finally:
            off.close()


@pytest.mark.parametrize("verdicts", ["immediate", "deferred"])
def test_skip_nonfinite_updates_skips_the_update_as_a_grad_scaler_would(verdicts: str) -> None:
    """monitor.skip_nonfinite_updates(): optimizer.step() (with or without a closure) applies finite steps and skips
    a NaN one; close() gives the optimizer its own step back; LBFGS and grad_checks=False are refused by name."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    monitor = sdc.SDCMonitor(net, opt, config=sdc.SDCConfig(verdicts=verdicts, **OFF))
    monitor.skip_nonfinite_updates()
    monitor.skip_nonfinite_updates()  # a second call changes nothing
    before = net.weight.detach().clone()
    for x in (torch.ones(3, 4), torch.full((3, 4), math.nan)):
        with monitor.step(x) as step:
            step.backward(net(x).sum())
        assert opt.step(lambda: torch.tensor(1.5)) == 1.5  # a closure runs first and its loss is returned
        opt.zero_grad()
    assert not torch.equal(net.weight, before) and bool(torch.isfinite(net.weight).all())
    monitor.close()
    assert "step" not in vars(opt)
    with pytest.raises(ValueError, match="LBFGS"):
        lbfgs = torch.optim.LBFGS(net.parameters())
        other = sdc.SDCMonitor(net, lbfgs, config=sdc.SDCConfig(**OFF))
        try:
            other.skip_nonfinite_updates()
        finally:
            other.close()
    with pytest.raises(ValueError, match="grad_checks"):
        other = sdc.SDCMonitor(net, opt, config=sdc.SDCConfig(grad_checks=False, **OFF))
        try:
            other.skip_nonfinite_updates()
        finally:
            other.close()


def test_models_the_checks_cannot_read_are_refused_at_construction() -> None:
    """A meta-device model (not materialized yet) and a sparse-gradient embedding are refused when the monitor is
    built, naming the parameter or module, instead of failing at the end of the first step."""
    with torch.device("meta"):
        meta = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"meta device .*'weight'.*to_empty"):
        sdc.SDCMonitor(meta, torch.optim.SGD(meta.parameters(), lr=0.1), config=sdc.SDCConfig(**OFF))
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="module '0' makes sparse gradients"):
        sdc.SDCMonitor(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), config=sdc.SDCConfig(**OFF))


def test_a_metrics_host_this_machine_cannot_bind_is_refused_at_set_up() -> None:
    """An address of no local interface is a configuration error naming metrics_host (a busy port is not: the
    endpoint is then skipped and training goes on)."""
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"SDCConfig\.metrics_host='192\.0\.2\.7' cannot be bound"):
        sdc.SDCMonitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       config=sdc.SDCConfig(metrics_host="192.0.2.7", metrics_port=29871, nvml=False))


def test_a_step_whose_entry_raised_is_closed_and_the_next_one_works(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registering the step's batch raises while the step opens (before the block runs; a batch the replay cannot
    ship does this): the step is closed on this rank, and the next monitor.step() opens and checks normally."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF))

    def refuse(batch: object) -> None:
        raise TypeError("the batch holds an object the replay cannot ship")

    monkeypatch.setattr(monitor, "capture", refuse)
    with pytest.raises(TypeError, match="cannot ship"):
        with monitor.step(torch.ones(2, 4)):
            pass
    monkeypatch.undo()
    x = torch.ones(3, 4)
    with monitor.step(x) as step:
        step.backward(model(x).sum())
    assert step.finite and monitor.current_step == 1
    monitor.close()


class _Results(sdc.Observer):
    def __init__(self) -> None:
        self.results: list[dict[str, str]] = []

    def report(self, report: sdc.StepReport) -> None:
        self.results.append(dict(report.results))


def test_a_step_without_backward_is_skipped_not_passed(one_rank: None) -> None:
    """A step whose block ran no backward measured nothing: grad_local (and grad_reduced) count skipped, in one
    process and under DDP, also while .grad still holds an earlier step's gradients."""
    for wrap in (False, True):
        model: nn.Module = nn.Linear(4, 2)
        model = DistributedDataParallel(model) if wrap else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = _Results()
        monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(replay_every=0, **OFF), observer=seen)
        x = torch.ones(3, 4)
        with monitor.step(x) as step:
            step.backward(model(x).sum())
        with monitor.step(x):  # no backward; .grad still holds the first step's
            pass
        monitor.close()
        first, second = seen.results
        grads = [{v for k, v in r.items() if k.startswith("grad")} for r in (first, second)]
        assert grads == [{"pass"}, {"skipped"}], (wrap, seen.results)
        # one replica: the weights' at-rest check has nothing to compare before an update
        assert first["weights"] == second["weights"] == "skipped", (wrap, seen.results)

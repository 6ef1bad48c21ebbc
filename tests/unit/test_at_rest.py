"""The weights' at-rest check in one process: a rank's own parameters and optimizer state must not change between
the update and the next weight check (checks/at_rest.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import sdc_telemetry as sdc
from sdc_telemetry.faults import flip_bit

OFF = {"metrics_port": None, "nvml": False}


class _Results(sdc.Observer):
    def __init__(self) -> None:
        self.results: list[dict[str, str]] = []

    def report(self, report: sdc.StepReport) -> None:
        if report.counts_step:
            self.results.append(dict(report.results))


def _run(steps: int, *, before: dict[int, object] | None = None, verdicts: str = "immediate",
         weights_every: int = 1) -> tuple[sdc.SDCMonitor, _Results, nn.Module, torch.optim.Optimizer]:
    """``steps`` steps of a small model with AdamW; ``before[k](model, opt, monitor)`` runs before step k's forward
    (after step k-1's update: memory at rest)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = _Results()
    monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(weights_every=weights_every, verdicts=verdicts, **OFF),
                             observer=seen)
    gen = torch.Generator().manual_seed(1)
    for k in range(steps):
        if before and k in before:
            before[k](model, opt, monitor)  # type: ignore[operator]
        x = torch.randn(4, 8, generator=gen)
        with monitor.step(x) as step:
            step.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor, seen, model, opt


@pytest.mark.parametrize("verdicts", ["immediate", "deferred"])
def test_healthy_steps_pass_after_the_first_update(verdicts: str) -> None:
    monitor, seen, _, _ = _run(6, verdicts=verdicts)
    assert monitor.incidents == []
    assert [r["weights"] for r in seen.results] == ["skipped"] + ["pass"] * 5  # nothing to compare before an update


@pytest.mark.parametrize("verdicts", ["immediate", "deferred"])
def test_a_weight_bit_flipped_at_rest_is_named(verdicts: str) -> None:
    flip = {3: lambda model, opt, mon: flip_bit(model[2].weight.data, index=5, bit=20)}
    monitor, seen, _, _ = _run(6, before=flip, verdicts=verdicts)
    [incident] = monitor.incidents
    assert (incident.step, incident.check, incident.suspect_ranks) == (3, "weights", (0,))
    ev = incident.evidence
    assert ev["verdict"] == "at_rest" and ev["ambiguous"] is False and ev["since_step"] == 2
    assert ev["differing_parameters"] == {"0": ["2.weight"]}
    assert ev["fingerprints"]["0"]["2.weight"] != ev["fingerprints_after_update"]["0"]["2.weight"]
    # once: the next update takes the (corrupted) weights as its reference
    assert [r["weights"] for r in seen.results] == ["skipped", "pass", "pass", "fail", "pass", "pass"]


def test_a_corrupted_adam_moment_is_named() -> None:
    def corrupt(model: nn.Module, opt: torch.optim.Optimizer, mon: sdc.SDCMonitor) -> None:
        flip_bit(opt.state[model[0].bias]["exp_avg_sq"], index=2, bit=25)

    monitor, _, _, _ = _run(5, before={2: corrupt})
    [incident] = monitor.incidents
    assert incident.step == 2 and incident.evidence["differing_parameters"] == {"0": ["0.bias [exp_avg_sq]"]}


def test_weights_changed_on_purpose_are_not_a_fault() -> None:
    """Code that changes the weights outside optimizer.step() says so; that check has nothing to compare."""
    def clamp(model: nn.Module, opt: torch.optim.Optimizer, mon: sdc.SDCMonitor) -> None:
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)
        mon.weights_changed()

    monitor, seen, _, _ = _run(5, before={2: clamp})
    assert monitor.incidents == []
    assert [r["weights"] for r in seen.results] == ["skipped", "pass", "skipped", "pass", "pass"]
    # without the call, the same change is a fault (the check cannot tell intent)
    unsaid, _, _, _ = _run(5, before={2: lambda model, opt, mon: model[0].weight.data.clamp_(-0.01, 0.01)})
    assert [(i.step, i.evidence["verdict"]) for i in unsaid.incidents] == [(2, "at_rest")]


def test_weights_every_n_compares_the_window_before_each_check() -> None:
    """weights_every=3: the reference is taken after the update that precedes a check (updates 2 and 5, checks at
    steps 3 and 6); a flip in that window is named, one earlier in the interval is not seen by this check."""
    covered = {6: lambda model, opt, mon: flip_bit(model[0].weight.data, index=1, bit=21)}
    monitor, seen, _, _ = _run(7, before=covered, weights_every=3)
    assert [(i.step, i.evidence["verdict"]) for i in monitor.incidents] == [(6, "at_rest")]
    assert [r.get("weights") for r in seen.results] == ["skipped", None, None, "pass", None, None, "fail"]
    uncovered = {5: lambda model, opt, mon: flip_bit(model[0].weight.data, index=1, bit=21)}
    blind, _, _, _ = _run(7, before=uncovered, weights_every=3)
    assert blind.incidents == []


def test_skipped_updates_keep_the_reference() -> None:
    """A step whose update is skipped (non-finite gradients, a GradScaler overflow) leaves the weights and the
    reference alone: the next check compares against the last update and passes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    seen = _Results()
    monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF), observer=seen)
    for k in range(5):
        x = torch.ones(3, 4)
        with monitor.step(x) as step:
            step.backward(model(x).sum() * (float("nan") if k == 2 else 1.0))
        if step.finite:
            opt.step()
        opt.zero_grad()
    monitor.close()
    assert [i.check for i in monitor.incidents] == ["grad_local"]
    assert [r["weights"] for r in seen.results] == ["skipped", "pass", "pass", "pass", "pass"]


def test_verify_weights_and_certificate_see_a_change_at_rest() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    monitor = sdc.SDCMonitor(model, opt, config=sdc.SDCConfig(**OFF))
    for _ in range(2):
        with monitor.step(torch.ones(1, 4)) as step:
            step.backward(model(torch.ones(1, 4)).sum())
        opt.step()
        opt.zero_grad()
    assert monitor.verify_weights() is None and monitor.certificate().verify(model) == []
    flip_bit(model.weight.data, index=0, bit=3)
    incident = monitor.verify_weights()
    assert incident is not None and incident.evidence["verdict"] == "at_rest"
    with pytest.raises(sdc.SDCDetected):  # nothing else holds the weights: nothing to certify
        monitor.certificate()
    monitor.close()


def test_the_vote_s_rows_are_reused_only_where_they_are_the_same_tensors() -> None:
    """At the check the at-rest comparison reads the vote's table rows by label: with a parameter left out of the
    optimizer (LoRA-style) or an optimizer whose state the vote does not hold (RMSprop), unchanged weights compare
    equal (no false alarm, no error)."""
    from sdc_telemetry.checks.at_rest import AtRestCheck
    from sdc_telemetry.checks.weights import WeightsCheck

    for frozen, cls in ((True, torch.optim.AdamW), (False, torch.optim.RMSprop)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        named = list(model.named_parameters())
        trained = [p for n, p in named if not (frozen and n == "0.weight")]
        opt = cls(trained, lr=1e-2)
        voted = opt if cls is torch.optim.AdamW else None  # as the monitor does: SGD, Adam, AdamW only
        vote = WeightsCheck(named, None, [0], optimizer=voted)
        check = AtRestCheck([n for n, _ in named], [p for _, p in named], opt, lambda t: t)
        for step in range(3):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            check.after_update(step)
            vote.measure()
            flag, compared = check.measure(vote.table, vote.labels)
            assert int(flag) == 1 and compared is not None, (cls.__name__, step)  # compared, unchanged
        flip_bit(opt.state[trained[-1]]["exp_avg" if frozen else "square_avg"], index=0, bit=20)
        vote.measure()
        flag, compared = check.measure(vote.table, vote.labels)
        assert int(flag) == 2 and compared is not None and compared.changed()[0][0] == "1.bias " + (
            "[exp_avg]" if frozen else "[square_avg]")

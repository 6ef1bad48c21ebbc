"""The update audit's recomputation (checks/update.py): a fresh optimizer of the same class and hyper-parameters,
one parameter at a time, reproduces the real step bit for bit; unsupported optimizers are named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sdc_telemetry.checks import update as U

CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-3}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True, "weight_decay": 1e-2, "foreach": True}),
    (torch.optim.AdamW, {"lr": torch.tensor(1e-3), "betas": (0.8, 0.95), "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 3e-4, "foreach": False, "maximize": True}),
]


@pytest.mark.parametrize(("cls", "hyper"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_recompute_reproduces_the_real_step_bit_for_bit(cls: type[torch.optim.Optimizer],
                                                        hyper: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = cls(model.parameters(), **hyper)
    for step in range(4):
        model(torch.randn(8, 16)).square().mean().backward()
        before = [(p.detach().clone(), p.grad.detach().clone(),
                   {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state.get(p, {}).items()},
                   U._hyper(opt.param_groups[0], [p])) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        for p, (p0, g0, s0, h) in zip(model.parameters(), before, strict=True):
            new_p, new_s = U.recompute(cls, h, p0, g0, s0)
            assert torch.equal(new_p, p.detach()), (step, cls.__name__)
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(new_s[k], v), (step, k)


def test_unsupported_optimizers_are_named() -> None:
    params = [nn.Parameter(torch.ones(2))]
    assert U.unsupported(torch.optim.AdamW(params)) is None
    reason = U.unsupported(torch.optim.Adagrad(params))
    assert reason is not None and "torch.optim.adagrad.Adagrad" in reason and "SGD, Adam, AdamW" in reason


def test_decide_names_the_origin_transient_persistent_and_partner() -> None:
    """Pure rules: position q recomputed origin_of[q]. A mismatch the origin's own rerun agrees with the partner on
    is transient; one it reproduces needs a referee (the partner's own auditor), who sides with one of the two."""
    good, bad = [(1, 1)], [(2, 2)]
    origin_of = [1, 2, 3, 0]  # q recomputes q + 1
    ranks = [10, 11, 12, 13]
    ok = {"rows": good, "after": good, "own": good, "labels": ["w"], "error": ""}

    def reports(origin: int, own: list[tuple[int, ...]]) -> list[dict[str, Any]]:
        out = [dict(ok) for _ in range(4)]
        out[origin_of.index(origin)] = {**ok, "after": bad}  # the partner's recomputation differs from what it applied
        out[origin] = {**out[origin], "own": own}
        return out

    transient = U.decide(reports(2, good), origin_of, ranks, {}, {})
    assert transient is not None and transient.suspect_ranks == (12,) and transient.evidence["verdict"] == "transient"
    persistent = reports(2, bad)
    assert U.plan_referees(persistent, origin_of) == [(2, 0)]  # the auditor of partner 1 referees
    named = U.decide(persistent, origin_of, ranks, {2: good}, {2: 0})
    assert named is not None and named.suspect_ranks == (12,) and not named.evidence["ambiguous"]
    assert named.evidence["origins"]["12"]["referee_rank"] == 10
    partner = U.decide(persistent, origin_of, ranks, {2: bad}, {2: 0})
    assert partner is not None and partner.suspect_ranks == (11,) and partner.evidence["origins"]["12"]["fault"] == \
        "partner"
    two = U.decide(persistent, origin_of, ranks, {}, {})
    assert two is not None and two.suspect_ranks == (11, 12) and two.evidence["ambiguous"]
    assert U.decide([dict(ok) for _ in range(4)], origin_of, ranks, {}, {}) is None


def test_slices_rotate_and_a_local_rerun_reproduces_each() -> None:
    """One process: the pre-hook copy, the post-hook fingerprints and the rerun agree on every slice; slices rotate
    through the parameters within their byte bound."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    named = list(model.named_parameters())
    for cls, hyper in ((torch.optim.AdamW, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})):
        opt = cls(model.parameters(), **hyper)
        audit = U.UpdateAudit([n for n, _ in named], [p for _, p in named], opt, lambda t: t, 1, slice_bytes=200)
        seen = []
        for step in range(5):
            model(torch.randn(3, 4)).sum().backward()
            audit.before_update(step)
            opt.step()
            audit.after_update(step)
            s = audit.pending
            assert s is not None and s.after_device is not None and audit.ready_for(step)
            s.after = [tuple(r) for r in s.after_device.tolist()]
            labels, rows = U.rerun(s, torch.device("cpu"))
            assert labels == s.labels and rows == s.after, (cls.__name__, step)
            seen.append(s.names)
            opt.zero_grad()
        assert seen == [["0.weight"], ["0.bias"], ["1.weight"], ["1.bias"], ["0.weight"]]


def test_a_share_larger_than_the_cap_is_audited_a_range_at_a_time() -> None:
    """One flat tensor (a ZeRO optimizer's partition) whose copies exceed max_bytes: each audit takes the next range
    of it, within the cap, wrapping at its end; the rerun of each range (AdamW with its moments) reproduces what the
    step applied there, and a wrong update of one element shows in the range that holds it only."""
    torch.manual_seed(0)
    part = nn.Parameter(torch.randn(100))
    opt = torch.optim.AdamW([part], lr=0.1)
    audit = U.UpdateAudit(["zero.fp32_partition.group0"], [part], opt, lambda t: t, 1, slice_bytes=10**6,
                          own=True, max_bytes=16 * 40)  # AdamW: 16 bytes an element once its moments exist
    seen = []
    for step in range(5):
        part.grad = torch.randn(100)
        audit.before_update(step)
        opt.step()
        if step >= 2:
            with torch.no_grad():
                part[45] += 1e-3  # a faulty unit: element 45 of what the update wrote, from step 2 on
        audit.after_update(step)
        s = audit.pending
        assert s is not None and s.after_device is not None
        s.after = [tuple(r) for r in s.after_device.tolist()]
        labels, rows = U.rerun(s, torch.device("cpu"))
        seen.append((s.names, labels == s.labels and rows == s.after))
    # step 0: no moments yet (8 bytes an element: 80 elements); then 40 at a time
    assert seen == [(["zero.fp32_partition.group0[0:80]"], True), (["zero.fp32_partition.group0[80:100]"], True),
                    (["zero.fp32_partition.group0[0:40]"], True), (["zero.fp32_partition.group0[40:80]"], False),
                    (["zero.fp32_partition.group0[80:100]"], True)]


def _local_audit(model: nn.Module, opt: torch.optim.Optimizer) -> U.UpdateAudit:
    named = list(model.named_parameters())
    audit = U.UpdateAudit([n for n, _ in named], [p for _, p in named], opt, lambda t: t, 1, slice_bytes=1 << 20)
    opt.register_step_pre_hook(lambda o, a, k: audit.before_update(audit.step_now))  # type: ignore[attr-defined]
    opt.register_step_post_hook(lambda o, a, k: audit.after_update(audit.step_now))  # type: ignore[attr-defined]
    return audit


def _reruns_match(audit: U.UpdateAudit, step: int) -> bool:
    s = audit.pending
    assert s is not None and s.step == step and s.after_device is not None
    s.after = [tuple(r) for r in s.after_device.tolist()]
    U._unpack(U.to_bytes(s.meta()))  # the description travels (weights_only loading)
    labels, rows = U.rerun(s, torch.device("cpu"))
    return labels == s.labels and rows == s.after


def test_a_fused_step_under_a_grad_scaler_is_recomputed_with_its_scale() -> None:
    """A GradScaler unscales inside a fused AdamW step (grad_scale and found_inf set on the optimizer around the
    call): the copy takes them, and the recomputation from the still-scaled gradients matches what was applied."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    audit = _local_audit(model, opt)
    for step in range(3):
        audit.step_now = step  # type: ignore[attr-defined]
        scaler.scale(model(torch.randn(4, 8)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        assert audit.pending is not None and set(audit.pending.scaling) == {"grad_scale", "found_inf"}
        assert _reruns_match(audit, step), step
        opt.zero_grad()


def test_hyper_parameters_travel_as_plain_values() -> None:
    """A learning rate set by hand as a numpy scalar (a schedule's output) travels as a Python number."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    audit = _local_audit(model, opt)
    for step in range(2):
        audit.step_now = step  # type: ignore[attr-defined]
        for group in opt.param_groups:
            group["lr"] = np.float64(1e-3 * (step + 1))
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        assert _reruns_match(audit, step), step
        opt.zero_grad()

"""``update``: a partner recomputes one rank's optimizer step and compares the result with what the rank applied.

Where no replica holds a tensor (FSDP2 on a 1-D mesh, sharded optimizers) a wrong update of a rank's own shard (a
faulty unit in the optimizer's kernel) spreads nowhere else, so neither the vote nor the replay can see it; with two
replicas the vote cannot say which update was wrong. The audit, every ``update_every`` steps:

1. In the optimizer's step pre-hook (local, no collective: the step may be skipped on some rank), this rank copies
   a slice of its local shards, the pre-update parameter, its gradient as the optimizer sees it (clipped, unscaled)
   and its optimizer state, with the group's hyper-parameters; in the post-hook it fingerprints what the update made
   of them. Slices rotate through the parameters, each bounded in bytes (``slice_bytes``): an audit holds one slice.
2. At the end of the next step (every rank reaches it; run only when every rank holds its slice, agreed in the
   status vector), every rank sends its slice to the rank that audits it (a partner on another host) and receives
   the slice of the rank it audits: one point-to-point exchange of about three shards of the slice.
3. The partner recomputes that update with a fresh optimizer of the same class and hyper-parameters (the
   implementation the origin used: foreach, fused, or one tensor at a time) and compares fingerprints of the new
   parameters and state with the origin's. The origin reruns its own slice too: a rerun that reproduces what it
   applied makes the fault ``persistent``, one that agrees with the partner ``transient``.

Elementwise optimizers only: ``SUPPORTED`` (SGD, Adam, AdamW, in their single-tensor, foreach and fused forms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from sdc_telemetry.checks.shipping import exchange_bytes, from_bytes, to_bytes
from sdc_telemetry.checks.weights import state_rows
from sdc_telemetry.core.evidence import MAX_ITEMS
from sdc_telemetry.core.findings import Finding
from sdc_telemetry.core.fingerprint import fingerprint, format_fingerprint

__all__ = ["SUPPORTED", "Slice", "UpdateAudit", "recompute", "unsupported"]

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def unsupported(optimizer: torch.optim.Optimizer) -> str | None:
    """Why the update audit cannot recompute this optimizer's step (None: it can)."""
    if type(optimizer) in SUPPORTED:
        return None
    names = ", ".join(c.__name__ for c in SUPPORTED)
    return (f"the update audit recomputes elementwise optimizers only ({names}, and their foreach and fused forms); "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not one of them")


def _hyper(group: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The group's hyper-parameters as the step used them (tensors copied to the host), with the implementation
    resolved the way the optimizer resolved it for these parameters (foreach/fused on a GPU differ in rounding
    from the single-tensor loop, and a DTensor parameter takes the single-tensor loop)."""
    out: dict[str, Any] = {}
    for k, v in group.items():
        if k != "params":
            out[k] = _plain(v)
    if out.get("foreach") is None and not out.get("fused"):
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _, foreach = _default_to_fused_or_foreach(list(params), bool(out.get("differentiable", False)),
                                                  use_fused=False)
        out["foreach"] = bool(foreach)
    return out


def _plain(v: Any) -> Any:
    """A hyper-parameter as it can travel (``torch.load(weights_only=True)``): tensors copied to the host, numpy and
    other numeric scalars as Python numbers, tuples and lists walked; anything else as its text (the recomputation
    then reads what the class's default would be, and a difference shows as a mismatch, never a hang)."""
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    if v is None or type(v) in (bool, int, float, str):  # exact types: numpy's float64 is a float subclass
        return v
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x) for x in v)
    item = getattr(v, "item", None)
    if callable(item):
        try:
            value = item()
            if type(value) in (bool, int, float):
                return value
        except (TypeError, ValueError):
            pass
    return str(v)


def recompute(cls: Callable[..., torch.optim.Optimizer], hyper: dict[str, Any], param: torch.Tensor,
              grad: torch.Tensor | None, state: dict[str, Any], scaling: dict[str, Any] | None = None,
              owned: bool = False) -> tuple[torch.Tensor, dict[str, Any]]:
    """One optimizer step of ``cls`` on ``param``, ``grad`` and ``state`` with ``hyper``: the new parameter and
    state (plain local tensors). ``scaling``: the ``grad_scale``/``found_inf`` a GradScaler set on the optimizer for
    a fused step. ``owned``: the tensors are this call's to update in place (received ones); otherwise copies are
    updated."""
    def mine(x: torch.Tensor) -> torch.Tensor:
        return x.detach() if owned else x.detach().clone()

    p = torch.nn.Parameter(mine(param), requires_grad=True)
    p.grad = None if grad is None else mine(grad)
    opt = cls([p])
    opt.param_groups[0].update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in hyper.items()})
    opt.state[p] = {k: mine(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    for name, value in (scaling or {}).items():  # a GradScaler hands a fused step these as attributes
        setattr(opt, name, value)
    opt.step()
    return p.detach(), dict(opt.state[p])


def _fingerprints(params: Sequence[torch.Tensor], states: Sequence[dict[str, Any]], names: Sequence[str]
                  ) -> tuple[list[str], torch.Tensor]:
    """Labels and fingerprint rows of each parameter followed by its state tensors, in a fixed order (not the scalar
    step counts, which Adam keeps on the CPU: they travel, and the recomputed moments show a wrong one)."""
    labels: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, param, state in zip(names, params, states, strict=True):
        labels.append(name)
        tensors.append(param)
        for label, key in state_rows(name, state):
            labels.append(label)
            tensors.append(state[key])
    return labels, fingerprint([t.detach() for t in tensors])


@dataclass
class Slice:
    """One rank's audited slice of an update: what went in (on the host), and fingerprints of what came out."""

    step: int
    cls: str                                   # the optimizer class, module-qualified
    names: list[str]
    params: list[torch.Tensor]                 # pre-update local parameters
    grads: list[torch.Tensor | None]
    states: list[dict[str, Any]]               # pre-update state (tensors copied)
    hyper: list[dict[str, Any]]
    scaling: dict[str, Any] = field(default_factory=dict)  # grad_scale / found_inf a GradScaler set
    labels: list[str] = field(default_factory=list)
    after: list[tuple[int, ...]] | None = None  # fingerprints of the applied update (host, read at the audit)
    after_device: torch.Tensor | None = None

    def meta(self) -> dict[str, Any]:
        """What travels ahead of the tensors: everything but them, and their layout."""
        layout, plain = _layout(self.params, self.grads, self.states)
        return {"step": self.step, "cls": self.cls, "names": self.names, "hyper": self.hyper,
                "scaling": self.scaling, "labels": self.labels, "after": self.after, "layout": layout,
                "plain": plain}


def _class(path: str) -> type[torch.optim.Optimizer]:
    for cls in SUPPORTED:
        if f"{cls.__module__}.{cls.__qualname__}" == path:
            return cls
    raise ValueError(f"not a supported optimizer: {path}")


def _layout(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
            states: Sequence[dict[str, Any]]) -> tuple[list[list[tuple[str, list[int], str]]], list[dict[str, Any]]]:
    """Per parameter, the tensors that travel ((key, shape, dtype): ``param``, ``grad``, ``state:<key>``), and the
    state's plain values."""
    layout, plain = [], []
    for p, g, st in zip(params, grads, states, strict=True):
        items = [("param", p), *((("grad", g),) if g is not None else ()),
                 *((f"state:{k}", v) for k, v in sorted(st.items(), key=lambda kv: str(kv[0]))
                   if isinstance(v, torch.Tensor))]
        layout.append([(key, list(x.shape), str(x.dtype).removeprefix("torch.")) for key, x in items])
        plain.append({k: v for k, v in st.items() if not isinstance(v, torch.Tensor)})
    return layout, plain


def _tensors(s: Slice, i: int) -> list[torch.Tensor]:
    """Parameter ``i``'s tensors of a slice, in its layout's order."""
    st = s.states[i]
    return [s.params[i], *((s.grads[i],) if s.grads[i] is not None else ()),
            *(v for _, v in sorted(st.items(), key=lambda kv: str(kv[0])) if isinstance(v, torch.Tensor))]


def _check_one(meta: dict[str, Any], i: int, tensors: Sequence[torch.Tensor], device: torch.device, owned: bool
               ) -> tuple[list[str], list[tuple[int, ...]]]:
    """Recompute parameter ``i`` of a slice (``meta``: its description) from its tensors: labels and rows."""
    cls = _class(meta["cls"])
    param: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    state: dict[str, Any] = dict(meta["plain"][i])
    hyper = meta["hyper"][i]
    on_device = bool(hyper.get("capturable") or hyper.get("fused"))  # Adam keeps its step count on the CPU else
    for (key, _, _), x in zip(meta["layout"][i], tensors, strict=True):
        x = x.to(device) if key != "state:step" or on_device else x
        if key == "param":
            param = x
        elif key == "grad":
            grad = x
        else:
            state[key.removeprefix("state:")] = x
    assert param is not None
    scaling = {k: v.to(device) for k, v in meta["scaling"].items()}
    new_p, new_s = recompute(cls, hyper, param, grad, state, scaling, owned=owned)
    labels, table = _fingerprints([new_p], [new_s], [meta["names"][i]])
    return labels, [tuple(r) for r in table.cpu().tolist()]


def rerun(s: Slice, device: torch.device) -> tuple[list[str], list[tuple[int, ...]]]:
    """Recompute a slice's update on ``device``, one parameter at a time, on copies: labels and fingerprint rows."""
    meta = s.meta()
    labels: list[str] = []
    rows: list[tuple[int, ...]] = []
    for i in range(len(s.names)):
        lab, r = _check_one(meta, i, _tensors(s, i), device, owned=False)
        labels += lab
        rows += r
    return labels, rows


def _unpack(data: torch.Tensor) -> dict[str, Any] | None:
    out = from_bytes(data)
    return out if isinstance(out, dict) else None


class UpdateAudit:
    """This rank's side of the update audit: the slices, the snapshot around the update, the exchange and the
    comparison. ``local``: this rank's share of a tensor; ``slice_bytes``: the host bytes a slice of several
    parameters stays within; ``max_bytes``: the most one audit copies (a larger share goes a range at a time)."""

    def __init__(self, names: Sequence[str], params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 local: Callable[[torch.Tensor], torch.Tensor], every: int, slice_bytes: int, *,
                 own: bool = False, max_bytes: int | None = None) -> None:
        self._names = list(names)
        self._params = list(params)
        self._optimizer = optimizer
        self._local = local
        self.every = every
        self._slice_bytes = slice_bytes
        self._max_bytes = max_bytes  # one share larger than this is audited a range at a time
        self._cursor = 0               # where the next slice starts (rotates through the parameters)
        # ``params`` are the optimizer's own tensors, every one of them stepped each update (a ZeRO optimizer's
        # partitions); False: the module's parameters, of which the optimizer may hold only some
        self._own = own
        self.pending: Slice | None = None
        self._chosen: list[tuple[int, int, int]] = []  # the pending slice: (parameter index, first, end element)
        self._offset = 0  # where the cursor's parameter resumes (a share audited a range at a time)
        self.errors: list[str] = []    # the last audit's errors, every rank's (gathered)

    def due(self, step: int) -> bool:
        """Step ``step``'s update is audited (its audit runs at the end of step + 1)."""
        return self.every > 0 and step % self.every == 0

    def ready_for(self, step: int) -> bool:
        """This rank holds the slice of step ``step``'s update, with what the update made of it."""
        return self.pending is not None and self.pending.step == step and self.pending.after_device is not None

    def _slice(self) -> list[tuple[int, int, int]]:
        """The next parameters whose copies fit in ``slice_bytes`` (at least one), rotating: (index, first, end
        element of this rank's share). A share whose copies exceed ``max_bytes`` is audited a range at a time (a ZeRO
        optimizer's flat partition, a huge embedding), so that one audit's host copy stays within it."""
        tracked = {id(p) for g in self._optimizer.param_groups for p in g["params"]}
        order = [i for i in range(len(self._params)) if id(self._params[i]) in tracked
                 and self._params[i].grad is not None]
        if not order:
            return []
        start = next((k for k, i in enumerate(order) if i >= self._cursor), None)
        if start is None:
            if self._own and len(tracked) < len(self._params):
                return []  # a ZeRO optimizer steps one group at a time: the cursor's group comes later
            start = 0
        if order[start] != self._cursor:
            self._offset = 0
        chosen: list[tuple[int, int, int]] = []
        used = 0
        for k in range(len(order)):
            i = order[(start + k) % len(order)]
            p = self._local(self._params[i])
            state = self._optimizer.state.get(self._params[i], {})
            per = p.element_size() * (2 + sum(isinstance(v, torch.Tensor) and v.numel() > 1 for v in state.values()))
            lo = self._offset if k == 0 else 0
            n = p.numel() - lo
            if self._max_bytes is not None and n * per > self._max_bytes:
                if chosen:
                    break
                n = max(1, self._max_bytes // max(per, 1))  # a range of this share fills the slice
            elif chosen and used + n * per > self._slice_bytes:
                break
            chosen.append((i, lo, lo + n))
            used += n * per
        i, _, end = chosen[-1]
        if end < self._local(self._params[i]).numel():
            self._cursor, self._offset = i, end  # the rest of this share comes first in the next audit
        else:
            self._cursor, self._offset = (i + 1 if i + 1 < len(self._params) else 0), 0
        return chosen

    def _part(self, t: torch.Tensor, chosen: tuple[int, int, int]) -> torch.Tensor:
        """The audited range of ``t`` (this rank's share of parameter ``chosen[0]``, or a state tensor of its size;
        anything else, such as a step count, whole)."""
        local = self._local(t)
        i, lo, end = chosen
        if local.numel() != self._local(self._params[i]).numel() or (lo == 0 and end == local.numel()):
            return local
        return local.reshape(-1)[lo:end]

    def before_update(self, step: int) -> None:
        """Optimizer pre-hook after step ``step``'s block: when that update is audited, copy the slice as the update
        will read it (local, no collective). A slice not audited yet is dropped (its audit skipped); a second
        ``optimizer.step()`` in the same step is not audited."""
        if not self.due(step) or (self.pending is not None and self.pending.step == step):
            return
        self.pending = None
        chosen = self._slice()
        if not chosen:
            return
        group_of = {id(p): g for g in self._optimizer.param_groups for p in g["params"]}
        host = torch.device("cpu")

        params, grads, states, hyper, names = [], [], [], [], []
        for c in chosen:
            i, lo, end = c
            p = self._params[i]

            def copy(t: torch.Tensor, c: tuple[int, int, int] = c) -> torch.Tensor:
                return self._part(t, c).detach().to(host, copy=True)

            params.append(copy(p))
            grads.append(None if p.grad is None else copy(p.grad))
            states.append({k: copy(v) if isinstance(v, torch.Tensor) else v
                           for k, v in self._optimizer.state.get(p, {}).items()})
            hyper.append(_hyper(group_of[id(p)], [p]))
            whole = lo == 0 and end == self._local(p).numel()
            names.append(self._names[i] if whole else f"{self._names[i]}[{lo}:{end}]")
        # A GradScaler unscales inside a fused step: it sets these on the optimizer around the call.
        scaling = {k: v.detach().to(host, copy=True) for k in ("grad_scale", "found_inf")
                   if isinstance(v := getattr(self._optimizer, k, None), torch.Tensor)}
        cls = type(self._optimizer)
        self.pending = Slice(step=step, cls=f"{cls.__module__}.{cls.__qualname__}", names=names, params=params,
                             grads=grads, states=states, hyper=hyper, scaling=scaling)
        self._chosen = chosen

    def after_update(self, step: int) -> None:
        """Optimizer post-hook: fingerprints of what the update made of the slice (on the device, no wait)."""
        s = self.pending
        if s is None or s.step != step or s.after_device is not None:
            return
        params = [self._part(self._params[c[0]], c).detach() for c in self._chosen]
        states = [{k: self._part(v, c) if isinstance(v, torch.Tensor) else v
                   for k, v in self._optimizer.state.get(self._params[c[0]], {}).items()} for c in self._chosen]
        s.labels, s.after_device = _fingerprints(params, states, s.names)

    def audit(self, step: int, pos: int, origin_of: Sequence[int], ranks: Sequence[int], group: Any,
              wire: torch.device, device: torch.device, gather: Callable[[object], list[object]]
              ) -> tuple[Finding | None, str]:
        """Collective (every rank, when every rank is ready for step ``step``): send this rank's slice to the rank
        that audits it, recompute the slice of ``origin_of[pos]``, rerun this rank's own, gather the outcomes, ask a
        referee where a persistent mismatch needs one, and decide (the same on every rank). Returns the finding and
        this rank's result."""
        mine = self.pending
        self.pending = None
        replayer = origin_of.index(pos)
        send_to, recv_from = ranks[replayer], ranks[origin_of[pos]]
        error = ""
        try:
            assert mine is not None and mine.after_device is not None
            mine.after = [tuple(r) for r in mine.after_device.cpu().tolist()]
            payload = to_bytes(mine.meta())
            _unpack(payload)  # what the partner will load: a description it could not read would leave it waiting
        except Exception as e:  # noqa: BLE001 - the peer must not wait forever: an empty record goes out
            error, payload, mine = f"packing the update slice failed: {type(e).__name__}: {e}", to_bytes(None), None
        received = exchange_bytes(payload, send_to, recv_from, group, wire)
        del payload
        try:
            theirs = _unpack(received)
        except Exception:  # noqa: BLE001 - both ends run this code: not expected; counted as an error below
            theirs = None
        del received
        report: dict[str, Any] = {"error": error, "rows": None, "after": None, "own": None, "labels": None}
        # Parameter by parameter: this rank's tensors out, its origin's in, recomputed and dropped before the next.
        labels: list[str] = []
        rows: list[tuple[int, ...]] = []
        failed = "" if theirs is not None else "the origin sent no slice"
        n_mine, n_theirs = len(mine.names) if mine else 0, len(theirs["names"]) if theirs else 0
        for i in range(max(n_mine, n_theirs)):
            ops = [dist.P2POp(dist.isend, x.contiguous().to(wire), send_to, group)
                   for x in (_tensors(mine, i) if mine is not None and i < n_mine else [])]
            bufs = [torch.empty(shape, dtype=getattr(torch, dtype), device=wire)
                    for _, shape, dtype in (theirs["layout"][i] if theirs is not None and i < n_theirs else [])]
            ops += [dist.P2POp(dist.irecv, b, recv_from, group) for b in bufs]
            if ops:
                for req in dist.batch_isend_irecv(ops):
                    req.wait()
            if bufs and not failed:
                assert theirs is not None
                try:
                    lab, r = _check_one(theirs, i, bufs, device, owned=True)
                    labels += lab
                    rows += r
                except Exception as e:  # noqa: BLE001 - counted; the exchange goes on to its end
                    failed = f"{type(e).__name__}: {e}"
            del bufs, ops
        if failed:
            report["error"] = error or f"recomputing the origin's update failed: {failed}"
        elif theirs is not None:
            if labels != theirs["labels"]:
                report["error"] = error or "recomputing the origin's update failed: other tensors than the origin's"
            else:
                report.update(rows=rows, after=[tuple(r) for r in theirs["after"]], labels=labels)
        if mine is not None:
            try:
                report["own"] = rerun(mine, device)[1]
            except Exception as e:  # noqa: BLE001
                report["error"] = report["error"] or f"rerunning its own update failed: {type(e).__name__}: {e}"
        reports = gather(report)
        self.errors = [f"rank {ranks[q]}: {r['error']}" for q, r in enumerate(reports)
                       if isinstance(r, dict) and r.get("error")]
        referees = plan_referees(reports, origin_of)
        verdicts: dict[int, list[tuple[int, ...]] | None] = {}
        for origin, referee in referees:  # the same list on every rank; each takes part in its own pairs only
            if pos == origin:
                _send_slice(mine, ranks[referee], group, wire)
            elif pos == referee:
                verdicts[origin] = _recv_slice(ranks[origin], group, wire, device)
        referee_rows = gather(verdicts) if referees else []
        by_origin: dict[int, list[tuple[int, ...]] | None] = {}
        for v in referee_rows:
            if isinstance(v, dict):
                by_origin.update(v)
        finding = decide(reports, origin_of, ranks, by_origin, dict(referees))
        result = "fail" if finding is not None else "error" if report["error"] else "pass"
        return finding, result


def _send_sized(payload: torch.Tensor, dst: int, group: Any, wire: torch.device) -> None:
    """The length, then the payload (blocking sends)."""
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8).to(wire), dst, group=group)
    dist.send(payload.to(wire), dst, group=group)


def _recv_sized(src: int, group: Any, wire: torch.device) -> torch.Tensor:
    """What ``_send_sized`` sent: the length, then the payload."""
    head = torch.zeros(8, dtype=torch.uint8, device=wire)
    dist.recv(head, src, group=group)
    size = int(head.cpu().view(torch.int64).item())
    body = torch.empty(size, dtype=torch.uint8, device=wire)
    dist.recv(body, src, group=group)
    return body


def _send_slice(s: Slice | None, dst: int, group: Any, wire: torch.device) -> None:
    """A slice to a referee: its description, then its tensors parameter by parameter (blocking sends)."""
    _send_sized(to_bytes(s.meta() if s is not None else None), dst, group, wire)
    for i in range(len(s.names) if s is not None else 0):
        assert s is not None
        for x in _tensors(s, i):
            dist.send(x.contiguous().to(wire), dst, group=group)


def _recv_slice(src: int, group: Any, wire: torch.device, device: torch.device) -> list[tuple[int, ...]] | None:
    """A referee's side of ``_send_slice``: the slice recomputed parameter by parameter (its rows), or None."""
    meta = _unpack(_recv_sized(src, group, wire))
    if meta is None:
        return None
    rows: list[tuple[int, ...]] = []
    failed = False
    for i in range(len(meta["names"])):
        bufs = [torch.empty(shape, dtype=getattr(torch, dtype), device=wire) for _, shape, dtype in meta["layout"][i]]
        for b in bufs:
            dist.recv(b, src, group=group)
        if not failed:
            try:
                rows += _check_one(meta, i, bufs, device, owned=True)[1]
            except Exception:  # noqa: BLE001 - no verdict from this referee; the exchange goes on to its end
                failed = True
        del bufs
    return None if failed else rows


def plan_referees(reports: Sequence[Any], origin_of: Sequence[int]) -> list[tuple[int, int]]:
    """(origin, referee) positions for each origin whose applied update its partner did not reproduce while its own
    rerun did (persistent: the partner or the origin is wrong). The referee is the partner's own partner, where it is
    neither of the two; none where the world is too small."""
    world = len(origin_of)
    out = []
    for q, r in enumerate(reports):
        if not isinstance(r, dict) or r.get("rows") is None or r.get("after") is None:
            continue
        o = origin_of[q]
        if r["rows"] == r["after"]:
            continue
        own = reports[o].get("own") if isinstance(reports[o], dict) else None
        if own is not None and own == r["rows"]:
            continue  # transient: the origin's rerun agrees with its partner
        referee = origin_of.index(q)  # the rank that audits the partner
        if world >= 3 and referee not in (o, q):
            out.append((o, referee))
    return out


def decide(reports: Sequence[Any], origin_of: Sequence[int], ranks: Sequence[int],
           referee_rows: dict[int, list[tuple[int, ...]] | None], referee_of: dict[int, int]) -> Finding | None:
    """The update audit's verdict from the gathered reports (``reports[q]``: rank position q's recomputation of
    ``origin_of[q]``'s slice), the same on every rank."""
    suspects: list[int] = []
    details: dict[str, Any] = {}
    ambiguous = False
    for q, r in enumerate(reports):
        if not isinstance(r, dict) or r.get("rows") is None or r.get("after") is None or r["rows"] == r["after"]:
            continue
        o = origin_of[q]
        own = reports[o].get("own") if isinstance(reports[o], dict) else None
        labels = r["labels"] or []
        differ = [(labels[i], format_fingerprint(a), format_fingerprint(b))
                  for i, (a, b) in enumerate(zip(r["after"], r["rows"], strict=True)) if tuple(a) != tuple(b)]
        entry: dict[str, Any] = {"partner_rank": ranks[q], "differing_tensors": [d[0] for d in differ[:MAX_ITEMS]],
                                 "differing_tensor_count": len(differ),
                                 "fingerprints": {d[0]: d[1] for d in differ[:MAX_ITEMS]},
                                 "partner_fingerprints": {d[0]: d[2] for d in differ[:MAX_ITEMS]}}
        if own is not None and own == r["rows"]:
            entry["fault"] = "transient"  # its own rerun computes what the partner computed
            suspects.append(o)
        else:
            entry["fault"] = "persistent"
            ref = referee_rows.get(o)
            if o in referee_of:
                entry["referee_rank"] = ranks[referee_of[o]]
            if ref is not None and ref == r["rows"]:
                suspects.append(o)  # the referee computes what the partner computed
            elif ref is not None and ref == r["after"]:
                suspects.append(q)  # the referee computes what the origin applied: the partner is wrong
                entry["fault"] = "partner"
            else:  # no referee (two ranks), or a third answer: either side may be wrong
                suspects += [o, q]
                ambiguous = True
        details[str(ranks[o])] = entry
    if not suspects:
        return None
    named = sorted(set(suspects))
    evidence: dict[str, Any] = {"ambiguous": ambiguous, "suspect_count": len(named),
                                "verdict": "persistent" if any(e["fault"] != "transient" for e in details.values())
                                else "transient",
                                "origins": dict(list(details.items())[:MAX_ITEMS])}
    return Finding("update", tuple(ranks[p] for p in named), evidence)

"""Software fault injection for tests, demos and fire drills. Deterministic: the same plan hits the same bits.

The injector counts optimizer steps itself (step 0 is the first step) through an optimizer post-step hook (a loop that
skips an update calls ``skipped_update()``), and acts only on the rank it is told to. It uses public hooks only, and
nothing on the detection path imports it::

    faults = FaultInjector(ddp_model, optimizer)
    faults.flip_weight_bit(rank=2, step=20, param="fc1.weight", index=3, bit=12)
    monitor = SDCMonitor(ddp_model, optimizer, loss_fn, config, comm_hook=faults.comm_hook)  # for reduced faults

What each fault does and when:
- ``flip_weight_bit``: XOR bit ``bit`` of element ``index`` (row-major; of this rank's shard for a fully_shard-ed
  model) of parameter ``param`` on ``rank``, just
  before step ``step``'s first forward pass (memory corruption between steps). With ``weights_every=1`` the weight
  check of that same step sees it. Bits 0-22 of an fp32 element are mantissa bits (always finite).
- ``swap_rows``: exchange rows ``i`` and ``j`` of parameter ``param`` on ``rank`` before step ``step``'s first forward
  pass (a wrong-address read or write: every value stays plausible, only positions change).
- ``nonfinite_grad``: replace element ``index`` (default: all) of ``param``'s local gradient on ``rank`` with
  ``value`` (NaN or Inf) in every backward pass of step ``step``, before DDP copies it into a bucket.
- ``perturb_output``: from step ``step`` on (``steps=None``) or for ``steps`` steps, multiply ``module``'s output by
  ``1 + relative`` on ``rank`` — a compute fault, so it also hits any recomputation on that rank. With
  ``transient=True`` only the first forward call of step ``step`` is hit (a fault that a rerun does not reproduce).
  With ``dither=True`` 16-bit outputs are rounded stochastically (``scaled``): a fault inside a float32 accumulation,
  before the output is rounded, so that one below half a unit in the last place still moves some elements.
- ``perturb_input_grad``: the same in ``module``'s backward: the gradient it passes back to its inputs (what a
  pipeline stage's first module sends to the previous stage) is multiplied by ``1 + relative``, its own parameters'
  gradients untouched. ``transient=True``: only the backward of step ``step``'s first forward call.
- ``corrupt_reduced_grad``: after the all-reduce of step ``step``, overwrite element ``index`` of the first bucket on
  ``rank`` with ``value`` (default NaN): corruption on the communication path. Needs ``comm_hook`` passed to
  the monitor (or registered on the DDP model when no monitor runs).
- ``corrupt_reduction``: inside the all-reduce of step ``step`` (after every rank's bucket went in, before the sum
  comes out), set element ``index`` of bucket ``bucket`` to ``value``, multiply it by ``factor`` or add ``delta``,
  identically on every rank: a fault in the reduction itself (a wrong partial sum that the all-gather spreads), so
  the replicas still agree. Needs ``comm_hook`` like ``corrupt_reduced_grad``.

``comm_hook`` reduces as DDP does (``sdc_telemetry.parallel.ddp.allreduce_as_ddp``, over the process group passed
as its state or else the DDP model's), so that the monitor's reduce-phase checksum travels with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FaultInjector", "flip_bit", "swap_rows"]


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """XOR one bit of element ``index`` (row-major) of ``tensor`` in place."""
    width = tensor.element_size() * 8
    if not 0 <= bit < width:
        raise ValueError(f"bit must be in 0..{width - 1} for {tensor.dtype}, got {bit}")
    if not 0 <= index < tensor.numel():
        raise ValueError(f"index must be in 0..{tensor.numel() - 1}, got {index}")
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    with torch.no_grad():
        flat = tensor.detach().view(-1).view(ints)
        mask = -(1 << bit) if bit == width - 1 and ints is not torch.uint8 else (1 << bit)
        flat[index] ^= mask


def swap_rows(tensor: torch.Tensor, i: int, j: int) -> None:
    """Exchange rows ``i`` and ``j`` (along the first dimension) of ``tensor`` in place."""
    if tensor.dim() == 0 or not (0 <= i < tensor.shape[0] and 0 <= j < tensor.shape[0]) or i == j:
        raise ValueError(f"rows {i} and {j} must be two distinct rows of a tensor of shape {tuple(tensor.shape)}")
    with torch.no_grad():
        row = tensor.detach()[i].clone()
        tensor.detach()[i] = tensor.detach()[j]
        tensor.detach()[j] = row


class FaultInjector:
    """Plans faults against one DDP model and optimizer on this rank. ``close()`` removes every hook."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, start_step: int = 0) -> None:
        self.model = model
        self.optimizer = optimizer
        self.module = getattr(model, "module", model)
        self.step = start_step
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.fired: list[str] = []
        self._reduced: list[tuple[int, int, float]] = []
        self._in_reduction: list[tuple[int, int, int, str, float]] = []  # step, bucket, index, how, operand
        self._scaling: dict[int, Any] = {}  # id(group) -> the DDPScaling state of the reduction
        self._handles = [optimizer.register_step_post_hook(self._advance)]

    def _advance(self, *_: Any) -> None:
        self.step += 1

    def skipped_update(self) -> None:
        """The loop skipped ``optimizer.step()`` this step (``if step.finite:``, or a GradScaler that found an
        overflow): count the step anyway, so that the plan's steps stay the loop's."""
        self.step += 1

    def _param(self, name: str | None) -> torch.nn.Parameter:
        params: dict[str, torch.nn.Parameter] = dict(self.module.named_parameters())
        if name is None:
            return next(iter(params.values()))
        if name not in params:
            raise ValueError(f"no parameter named {name!r}; known: {sorted(params)[:20]}")
        return params[name]

    def _submodule(self, name: str) -> torch.nn.Module:
        try:
            return self.module.get_submodule(name)
        except AttributeError:
            known = [n for n, _ in self.module.named_modules() if n]
            raise ValueError(f"no module named {name!r}; known: {known[:20]}") from None

    def flip_weight_bit(self, *, rank: int, step: int, param: str | None = None, index: int = 0, bit: int = 0
                        ) -> None:
        target = _local(self._param(param))  # a sharded (FSDP2) parameter: this rank's shard
        if not 0 <= bit < target.element_size() * 8 or not 0 <= index < target.numel():  # fail now, not at step
            raise ValueError(f"bit {bit} / index {index} out of range for {param} ({target.dtype}, "
                             f"{target.numel()} elements on this rank)")
        self._before_forward(rank, step, lambda: flip_bit(target.data, index, bit),
                             f"weight bit {bit} of {param}[{index}] at step {step}")

    def flip_state_bit(self, *, rank: int, step: int, param: str | None = None, key: str = "exp_avg", index: int = 0,
                       bit: int = 0) -> None:
        """Memory corruption of the optimizer's state (``key``: Adam's ``exp_avg``, ``exp_avg_sq``, SGD's
        ``momentum_buffer``) of ``param`` on this rank, just before step ``step``'s first forward pass (after the
        previous update: the state exists by then)."""
        target_param = self._param(param)

        def corrupt() -> None:
            state = self.optimizer.state.get(target_param, {})
            if key not in state:
                raise ValueError(f"the optimizer holds no {key!r} for {param} (it has {sorted(map(str, state))})")
            target = _local(state[key])
            if not 0 <= bit < target.element_size() * 8 or not 0 <= index < target.numel():
                raise ValueError(f"bit {bit} / index {index} out of range for {param} [{key}]")
            flip_bit(target.data, index, bit)

        self._before_forward(rank, step, corrupt, f"optimizer state bit {bit} of {param} [{key}][{index}] at step "
                                                  f"{step}")

    def swap_rows(self, *, rank: int, step: int, param: str | None = None, rows: tuple[int, int] = (0, 1)) -> None:
        target = _local(self._param(param))
        i, j = rows
        if target.dim() == 0 or not (0 <= i < target.shape[0] and 0 <= j < target.shape[0]) or i == j:
            raise ValueError(f"rows {rows} are not two distinct rows of {param} {tuple(target.shape)} on this rank")
        self._before_forward(rank, step, lambda: swap_rows(target.data, i, j),
                             f"rows {i} and {j} of {param} swapped at step {step}")

    def _before_forward(self, rank: int, step: int, action: Callable[[], None], what: str) -> None:
        """Run ``action`` once on ``rank``, just before step ``step``'s first forward pass."""
        done = False

        def pre_forward(*_: Any) -> None:
            nonlocal done
            if not done and self.rank == rank and self.step == step:
                done = True
                action()
                self.fired.append(what)

        # A list of pipeline stage modules (nn.ModuleList) is never called itself: its parts are, in turn.
        called = list(self.model) if isinstance(self.model, torch.nn.ModuleList) else [self.model]
        self._handles += [m.register_forward_pre_hook(pre_forward) for m in called]

    def nonfinite_grad(self, *, rank: int, step: int, param: str | None = None, index: int | None = None,
                       value: float = math.nan) -> None:
        if math.isfinite(value):
            raise ValueError(f"value must be NaN or +-Inf, got {value}")
        target = self._param(param)

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.rank != rank or self.step != step:
                return grad
            out = grad.clone()
            if index is None:
                out.fill_(value)
            else:
                out.view(-1)[index] = value
            self.fired.append(f"non-finite gradient in {param} at step {step}")
            return out

        self._handles.append(target.register_hook(hook))  # type: ignore[no-untyped-call]

    def flip_grad_bit(self, *, rank: int, step: int, param: str | None = None, index: int = 0, bit: int = 31
                      ) -> None:
        """Flip one bit of one element of ``param``'s local gradient on ``rank`` at ``step`` (every backward of that
        step on that rank): bit 31 of a float32 is the sign, bits 0-22 the mantissa (22 its most significant)."""
        target = self._param(param)
        width = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16, torch.float64: 64}.get(target.dtype)
        if width is None or not 0 <= bit < width:
            raise ValueError(f"bit must be in 0..{(width or 32) - 1} for {target.dtype}, got {bit}")
        as_int = {32: torch.int32, 16: torch.int16, 64: torch.int64}[width]

        def hook(grad: torch.Tensor) -> torch.Tensor:
            if self.rank != rank or self.step != step:
                return grad
            out = grad.clone()
            flat = out.view(-1).view(as_int)
            flat[index] ^= torch.tensor(1 << bit if bit < width - 1 else -(1 << bit), dtype=as_int)
            self.fired.append(f"bit {bit} of element {index} of {param}'s gradient flipped at step {step}")
            return out

        self._handles.append(target.register_hook(hook))  # type: ignore[no-untyped-call]

    def _calls(self, rank: int, step: int, steps: int | None, transient: bool) -> Callable[[], bool]:
        """Whether a compute fault fires at this call: on ``rank``, from ``step`` on (for ``steps`` steps), or only
        at the first call of ``step`` when ``transient``."""
        calls_at_step = 0

        def due() -> bool:
            nonlocal calls_at_step
            if self.rank != rank or self.step < step or (steps is not None and self.step >= step + steps):
                return False
            if transient:
                if self.step != step or calls_at_step > 0:
                    return False
                calls_at_step += 1
            return True
        return due

    def perturb_output(self, *, rank: int, step: int, module: str, relative: float = 1e-3,
                       steps: int | None = None, transient: bool = False, dither: bool = False,
                       first: bool = False) -> None:
        """Scale ``module``'s output on ``rank`` (see ``_calls`` for when). ``first``: before the module's other
        forward hooks (a compute fault inside a module whose output a hook then sends on, as expert parallelism's
        combine does)."""
        target = self._submodule(module)
        due = self._calls(rank, step, steps, transient)
        # dither: 16-bit outputs rounded stochastically (``scaled``), from a private generator (never the global RNG)
        gen = torch.Generator().manual_seed(0x5DC + rank) if dither else None

        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> Any:
            if not due():
                return out
            self.fired.append(f"output of {module} scaled by {1 + relative} at step {self.step}")
            if gen is None:
                return _map_tensors(out, lambda t: t * (1 + relative))
            return _map_tensors(out, lambda t: scaled(t, 1 + relative, _on(gen, t.device)))

        self._handles.append(target.register_forward_hook(hook, prepend=first))

    def perturb_input_grad(self, *, rank: int, step: int, module: str, relative: float = 1e-3,
                           steps: int | None = None, transient: bool = False) -> None:
        target = self._submodule(module)
        due = self._calls(rank, step, steps, transient)

        def pre(_m: torch.nn.Module, args: Any) -> Any:
            if not due():
                return None
            self.fired.append(f"gradient into {module}'s inputs scaled by {1 + relative} at step {self.step}")
            return _map_tensors(args, lambda t: _ScaleGrad.apply(t, 1 + relative)  # type: ignore[no-untyped-call]
                                if t.is_floating_point() and t.requires_grad else t)

        self._handles.append(target.register_forward_pre_hook(pre))

    def corrupt_reduced_grad(self, *, rank: int, step: int, index: int = 0, value: float = math.nan) -> None:
        self._reduced.append((rank, step, value))
        self._reduced_index = index

    def corrupt_reduction(self, *, step: int, index: int = 0, bucket: int = 0, value: float | None = None,
                          factor: float | None = None, delta: float | None = None) -> None:
        given = [(how, x) for how, x in (("value", value), ("factor", factor), ("delta", delta)) if x is not None]
        if len(given) != 1:
            raise ValueError("corrupt_reduction needs exactly one of value= (set), factor= (multiply) or delta= (add), "
                             f"got {[how for how, _ in given] or 'none'}")
        if index < 0 or bucket < 0:
            raise ValueError(f"index and bucket must be >= 0, got index={index} bucket={bucket}")
        self._in_reduction.append((step, bucket, index, given[0][0], float(given[0][1])))

    def comm_hook(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook: DDP's averaging all-reduce, then the planned corruptions of its result (on one rank for
        ``corrupt_reduced_grad``, on every rank for ``corrupt_reduction``). ``state``: a process group, or None for
        the DDP model's."""
        from sdc_telemetry.parallel.ddp import DDPScaling, allreduce_as_ddp

        group = state if isinstance(state, dist.ProcessGroup) else getattr(self.model, "process_group", None)
        if group is None:
            group = dist.distributed_c10d._get_default_group()
        scaling = self._scaling.get(id(group))
        if scaling is None:
            scaling = self._scaling[id(group)] = DDPScaling(group)
        fut = allreduce_as_ddp(scaling, bucket)
        step, index = self.step, bucket.index()
        hits = [v for r, s, v in self._reduced if r == self.rank and s == step] if index == 0 else []
        inside = [(i, how, x) for s, b, i, how, x in self._in_reduction if s == step and b == index]
        if not hits and not inside:
            return fut

        def corrupt(f: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            t = f.value()
            flat = t.view(-1)
            for i, how, x in inside:
                if i >= flat.numel():
                    raise ValueError(f"corrupt_reduction: index {i} is past bucket {index} ({flat.numel()} elements)")
                if how == "value":
                    flat[i] = x
                elif how == "factor":
                    flat[i] *= x
                else:
                    flat[i] += x
                self.fired.append(f"reduction of bucket {index} corrupted ({how} {x} at {i}) at step {step}")
            if hits:
                flat[self._reduced_index] = hits[0]
                self.fired.append(f"reduced gradient corrupted at step {step}")
            return t

        return fut.then(corrupt)

    def corrupt_update(self, *, rank: int, step: int, index: int = 0, relative: float = 1e-3,
                       transient: bool = False) -> None:
        """A faulty unit in this rank's optimizer kernel, from step ``step`` on: every update an optimizer of this
        class computes on ``rank`` (the training's, and any recomputation there) scales element ``index`` of each
        updated parameter (this rank's shard) by ``1 + relative``, inside the step: before the optimizer's
        post-hooks, so that what the update applied is wrong (not memory changed after it). ``transient``: only the
        training's own update of step ``step`` (a recomputation computes right)."""
        if self.rank != rank:
            return
        from torch.optim import Optimizer

        cls = type(self.optimizer)
        own = cls.__dict__.get("step")  # None: the class inherits its step (AdamW from Adam)
        hooked = cls.step
        raw = getattr(hooked, "__wrapped__", hooked)  # torch's wrapper runs the hooks around the class's step
        injector = self

        def faulty(opt: Any, *args: Any, **kwargs: Any) -> Any:
            out = raw(opt, *args, **kwargs)
            if (injector.step == step and opt is injector.optimizer) if transient else injector.step >= step:
                with torch.no_grad():
                    for group in opt.param_groups:
                        for p in group["params"]:
                            local = _local(p)
                            if p.grad is not None and local.numel() > index:
                                local.view(-1)[index] *= 1 + relative
                if f"update of step {injector.step}" not in injector.fired:
                    injector.fired.append(f"update of step {injector.step}")
            return out

        wrapped = Optimizer.profile_hook_step(faulty)  # type: ignore[arg-type]
        wrapped.hooked = True  # type: ignore[attr-defined]
        cls.step = wrapped  # type: ignore[method-assign, assignment]

        class _Restore:
            def remove(self) -> None:
                if own is None:
                    del cls.step
                else:
                    cls.step = own  # type: ignore[method-assign]

        self._handles.append(_Restore())  # type: ignore[arg-type]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


# DDP checks a hook's annotations against the real classes; postponed (string) annotations would fail that check.
FaultInjector.comm_hook.__annotations__ = {}


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t  # type: ignore[no-any-return]


def scaled(t: torch.Tensor, factor: torch.Tensor | float, dither: torch.Generator | None = None) -> torch.Tensor:
    """``t * factor`` computed in float32 (float64 for float64) and rounded back to ``t``'s dtype: to nearest, or with
    ``dither`` (a generator) stochastically for 16-bit floats, as if the change happened inside a higher-precision
    accumulation before the output was rounded: an element moves to the neighbouring value with probability its
    distance over the gap, so a change below half a unit in the last place still moves some elements (the expected
    change is the exact one), where rounding to nearest would give the same bits back. Non-float tensors pass."""
    if not t.is_floating_point():
        return t
    wide = torch.float64 if t.dtype == torch.float64 else torch.float32
    exact = t.to(wide) * factor
    nearest = exact.to(t.dtype)
    if dither is None or t.dtype not in (torch.bfloat16, torch.float16):
        return nearest
    back = nearest.to(wide)
    toward = torch.where(exact > back, torch.full_like(nearest, math.inf), torch.full_like(nearest, -math.inf))
    other = torch.nextafter(nearest, toward)
    gap = (other.to(wide) - back).abs()
    chance = torch.where(gap > 0, (exact - back).abs() / gap, torch.zeros_like(gap))
    draw = torch.rand(t.shape, generator=dither, device=t.device, dtype=wide)
    return torch.where(draw < chance, other, nearest)


class _ScaleGrad(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by ``factor`` (a fault in the backward kernel that
    computes a module's input gradient)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _on(gen: torch.Generator, device: torch.device) -> torch.Generator | None:
    """``gen`` where it can draw for ``device`` (a CPU generator for CPU tensors; else no dithering)."""
    return gen if gen.device.type == device.type else None


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj

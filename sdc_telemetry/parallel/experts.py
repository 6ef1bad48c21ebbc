"""Expert parallelism (torchtitan's MoE layout): experts sharded over an ``ep`` dimension, tokens exchanged by
all-to-all.

A MoE layer's experts are one module whose weights hold every expert on dim 0 (torchtitan's GroupedExperts);
expert parallelism shards them over the ``ep`` dim of a sparse mesh ``(dp_replicate, efsdp, ep)`` that splits the
dense mesh's ``dp_shard`` (``dp_shard = efsdp x ep``, ep innermost), and ``fully_shard`` shards them further over
``efsdp``. Its input hook sends each token to the rank of its expert, its output hook sends the results back. What
follows for the checks:

- **replica**: the ``ep`` ranks of one ``efsdp`` index exchange tokens, so together they compute their micro-batches:
  they are one replica (its slots are the ``ep`` ranks), and the replicas are ``dp_replicate x efsdp``. A replay pairs
  two such groups: slot e of the partner recomputes slot e's micro-batch, and its all-to-alls with the partner's other
  slots carry the same tokens as the origin's did.
- **shard key**: ``(dp_shard)`` as for dense FSDP: ranks with the same ``dp_shard`` index hold the same dense shard
  and the same experts' shard (the same ``ep`` and ``efsdp`` index), so weights are compared across ``dp_replicate``.
- **localising within a replica**: one rank's wrong result reaches every slot of its replica through the all-to-alls.
  On scheduled audits each rank records, per MoE layer, the input of the experts' parent (the tokens it is about to
  send, where the parent dispatches them, as torchtitan's RoutedExperts does), the tokens its experts received,
  what they computed (before the combine) and what came back to the parent; in exact mode the replay compares them
  with the origin's in forward order, and the first record that differs names its ranks: tokens sent, the rank's
  own computation since the previous layer's results came back; expert output (every token matched), the rank's
  experts (``evidence["moe_layer"]``: the experts' module name).

Covered: ``ep`` over ``dp_shard`` (with or without ``dp_replicate``). Refused by name: ``ep`` together with tensor,
context or pipeline parallelism, expert tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from sdc_telemetry.parallel.base import LayoutError
from sdc_telemetry.parallel.outputs import StageOutputs

__all__ = ["ExpertLayout", "expert_layout", "ExpertOutputs"]


class ExpertLayout:
    """The expert-parallel part of a model: the ep size, this rank's ep index, the modules that hold the experts,
    their parents and their names."""

    def __init__(self, size: int, index: int, modules: list[torch.nn.Module], parents: list[torch.nn.Module],
                 names: list[str]) -> None:
        self.size, self.index, self.modules, self.parents, self.names = size, index, modules, parents, names


def expert_layout(model: torch.nn.Module, sizes: dict[str, int]) -> ExpertLayout | None:
    """The model's expert parallelism (parameters on a mesh with an ``ep`` dim), checked against the dense mesh's dims
    ``sizes``; None when there is none. ``LayoutError`` names what is not covered."""
    from torch.distributed.tensor import DTensor

    modules, parents, names, meshes = [], [], [], []
    parent_of = {id(child): module for module in model.modules() for child in module.children()}
    for name, module in model.named_modules():
        held = [p for p in module.parameters(recurse=False)
                if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())]
        if held:
            if id(module) not in parent_of:
                raise LayoutError("the root module holds expert-parallel parameters: keep the experts in a submodule "
                                  "(torchtitan's GroupedExperts inside its RoutedExperts)")
            modules.append(module)
            parents.append(parent_of[id(module)])
            names.append(name)
            meshes += [p.device_mesh for p in held]
    if not modules:
        return None
    size = _ep_size(meshes[0])
    index = meshes[0].get_local_rank("ep")
    if any(_ep_size(m) != size or m.get_local_rank("ep") != index for m in meshes):
        raise LayoutError("expert parameters on different ep meshes: shard every MoE layer's experts over one ep dim")
    if size < 2:
        return None
    for d in ("pp", "cp", "tp"):
        if sizes.get(d, 1) > 1:
            raise LayoutError(f"expert parallelism together with {d} (a {d} dimension of {sizes[d]}) is not supported "
                              "yet: ep over dp_shard, with or without dp_replicate, is")
    if any("etp" in (m.mesh_dim_names or ()) for m in meshes):
        raise LayoutError("expert tensor parallelism (an etp dim) is not supported")
    shard = sizes.get("dp_shard", 1)
    if shard % size:
        raise LayoutError(f"the ep dim ({size}) does not divide dp_shard ({shard}): expert parallelism splits the "
                          "dense mesh's dp_shard into (efsdp, ep), as torchtitan's sparse mesh does")
    return ExpertLayout(size, index, modules, parents, names)


def _ep_size(mesh: Any) -> int:
    return int(mesh.size(tuple(mesh.mesh_dim_names or ()).index("ep")))


class ExpertOutputs(StageOutputs):
    """Per MoE layer, in forward order, four records of this rank (recorded while a recording is in force): the
    input of the experts' parent module (channel ``4 * layer``: the tokens it is about to send, where the dispatch
    happens in the parent's forward, as in torchtitan's RoutedExperts), the experts' input (``+ 1``: the tokens they
    received), their output (``+ 2``, before any hook sends it on) and the parent's output (``+ 3``: the results
    that came back). ``narrow`` names the first that differs. ``modules``: the modules that hold the experts;
    ``parents``: their parents; ``names``: the modules' names, for evidence."""

    #: the evidence keys of a narrowed finding (the experts' module, and which record named it)
    evidence_keys = ("moe_layer", "moe_found_by")
    #: the forwards run in the training loop's own code: recorded from the step's opening to its audit
    whole_step = True

    def __init__(self, modules: Sequence[torch.nn.Module], parents: Sequence[torch.nn.Module], names: Sequence[str],
                 positions: int) -> None:
        super().__init__([], [[]] * positions)
        self.parts = 4 * len(modules)
        self.names = list(names)
        # the parent's input and the experts' output prepended: before the hooks that may dispatch or combine; the
        # experts' input appended: after them (what the experts compute on)
        self._handles = [h for k, (m, parent) in enumerate(zip(modules, parents, strict=True)) for h in (
            parent.register_forward_pre_hook(self._inputs(4 * k), prepend=True),
            m.register_forward_pre_hook(self._inputs(4 * k + 1)),
            m.register_forward_hook(self._computed(4 * k + 2), prepend=True),
            parent.register_forward_hook(self._computed(4 * k + 3)))]

    def _inputs(self, channel: int) -> Callable[..., None]:
        def on_input(_module: torch.nn.Module, inputs: Any) -> None:
            if self._rows is not None:
                self._record(inputs, channel)
        return on_input

    def _computed(self, channel: int) -> Callable[..., None]:
        def on_output(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            if self._rows is not None:
                self._record(output, channel)
        return on_output

    def encode(self, differs: Sequence[bool]) -> int:
        """A comparison's mark: 1 + the first channel that differed, 0 when none did (only the first is used, and
        it fits an int64 at any number of layers)."""
        return next((k + 1 for k, d in enumerate(differs) if d), 0)

    @staticmethod
    def merge(a: int, b: int) -> int:
        """A position's marks of two comparisons: the earlier first difference."""
        return min(a, b) if a and b else a or b

    def sent_differs(self, mark: int) -> bool:
        return False

    def narrow(self, suspects: tuple[int, ...], marks: dict[int, int], mode: str
               ) -> tuple[tuple[int, ...], tuple[str, str] | None]:
        """Exact mode: the suspects whose record differs first, in forward order, with (the experts' module name,
        ``tokens_sent`` or ``expert_output``). Tokens sent depend only on the rank's own computation since the
        results of the layer before came back, and an expert output on the tokens received, so where every earlier
        record matched on every rank, the first to differ of these two kinds was computed wrongly by its rank.
        Nothing narrowed where the first to differ is a received one (tokens received, results come back: the
        sender, the link or the combine cannot be told apart), where every suspect's record differs (the replica as
        a whole), where none does, or in tolerance mode (a record's noise over the threshold would name its rank)."""
        if mode != "exact":
            return suspects, None
        first = {p: marks[p] - 1 for p in suspects if marks[p] > 0}
        if not first:
            return suspects, None
        channel = min(first.values())
        differ = tuple(p for p in suspects if first.get(p) == channel)
        if channel % 4 in (1, 3) or len(differ) == len(suspects):
            return suspects, None
        return differ, (self.names[channel // 4], "tokens_sent" if channel % 4 == 0 else "expert_output")

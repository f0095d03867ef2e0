"""ZeRO-3 parameter coordinator: module hooks that gather units just in time and reduce-scatter
their gradients as soon as backward has finished with them.

Forward: a module's pre-hook acquires every unit it uses (one all-gather per unit not already
gathered), its post-hook releases them; nested modules nest acquisitions (reference counts in
ShardedUnit). Under `torch.no_grad()` that is all that happens. With grad enabled the post-hook
also arms a pre-backward hook on the module's outputs.

Backward: see [Note: ZeRO-3 backward]. This coordinator owns only *when* things happen; what a
unit holds and how it is gathered or reduced is ShardedUnit's business. Hooks on the root
module delimit forward passes for the Prefetcher ([Note: ZeRO-3 prefetch trace] in prefetch.py).

[Note: ZeRO-3 backward]
1. Pre-backward: `register_multi_grad_hook(outputs, mode="any")` fires once per backward
   graph task, when the first gradient w.r.t. one of the module's outputs is computed, i.e.
   before autograd runs any node of the module's backward. It re-gathers the module's units
   and *holds* them for this backward. See [Note: ZeRO-3 release and autograd's saved tensors].
2. Gradient completion: autograd has one AccumulateGrad node per leaf parameter and sums all
   incoming gradients in its input buffer before running it, so a parameter used twice (a
   module called twice, a tied weight used by two modules) still gets exactly one
   post-accumulate-grad hook call per backward. A unit is complete when each of its trainable
   parameters reported once; it is then handed to the reducer (reducer.py: reduce-scattered
   alone or in a bucket with other small units) and released. Completion implies every
   backward node with an edge to those parameters already ran, so nothing reads them later in
   this backward. Cost: a unit stays gathered from the first backward use of any module that
   needs it until its last parameter's gradient is accumulated (a tied embedding stays gathered
   between the output head's backward and the embedding's backward).
   A unit owned by a z3 leaf module is the exception: see [Note: leaf units complete by module].
3. Epilogue: a callback queued on the autograd engine (deepspeed/runtime/backward_hooks.py)
   runs when the graph task ends. It reduces, in unit order (the same on every rank), each
   trainable unit not reduced yet -- parameters that got no gradient contribute zeros -- and
   flushes the reducer's last bucket, so every rank reduces every trainable unit exactly once
   per backward whatever its local graph used, then releases anything still held (frozen units
   have no gradient hook).
4. A gradient may also arrive for a parameter no module's backward holds: see [Note: gradients
   for released parameters].
Collective order must be the same on every rank: the model must run the same modules in the
same order on every rank (data-dependent routing belongs inside a z3 leaf module).

[Note: ZeRO-3 expert units]
An expert parameter (engine_moe.py, [Note: expert gradients]) is replicated over its
expert-data-parallel (EDP) group only: other EP ranks hold other experts under the same name. Its
unit is therefore partitioned over that group (`param_groups`), and a module owning both kinds
gets one unit per kind (`plan_units(kind_of=...)`), so every unit has one group: its all-gathers
and reduce-scatters run there (a bucket never mixes groups, reducer.py), its gradient is summed
over the EDP group and scaled by the reduce policy's 1/W like every unit, and each element of an
expert lives in exactly one shard of its EDP group, so the global norm's sum over all W ranks
counts every expert once. Every rank has the same units in the same order (distinct EDP groups
hold the same number of experts), so each group's collectives match across its members. Checkpoints
gather each unit over its own group (checkpoint/moe_io.py). Not combined yet (refused by engine_moe.py and
stage3/optimizer.py): ZeRO++, zero.Init-built experts, Muon; hpZ's node copy is for units on ZeRO's group only.

[Note: leaf units complete by module]
Inside a leaf module the graph may differ by rank (MoE routing: rank 0's tokens reach experts
0-3, rank 1's only expert 0). Completion by parameter would then differ too: rank 0 completes
the leaf's unit during the backward, rank 1 never (expert 1-3 get no gradient there) and only
reduces it in the epilogue, so the ranks' reduce-scatters pair with different collectives
(a hang or a wrong sum). Every unit a leaf uses (its own, and tied or external ones owned elsewhere) therefore ignores
its parameters' hooks. Each grad-enabled forward call of a module using such a unit registers a
hook that fires once the gradients of the call's inputs are computed
(`register_multi_grad_hook(mode="all")` on the floating inputs that require grad). Such a hook
runs as a pre-hook of the input's grad_fn, a node created before the call's nodes: autograd
runs nodes in decreasing creation order and a parameter's AccumulateGrad as soon as it is ready
(highest priority), so by then the call's backward has run and its gradients are accumulated.
When the last call's hook fired the unit is reduced: a point fixed by the module structure, the
same on every rank. An input without a grad_fn (a leaf tensor: the model's input, or the
detached input of a reentrant checkpoint) gives no such guarantee -- its hook fires before its
own AccumulateGrad, possibly before a parameter's -- so a call with one, or with no input that
needs a gradient, registers nothing and its units wait for the epilogue, on every rank alike.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from functools import partial
from typing import Any, Iterator

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from ....utils.logging import logger
from ....utils.weak_hooks import remove_when_collected, weak_hook
from ....utils.z3_leaf_module import z3_leaf_module
from ...backward_hooks import in_autograd_backward, output_tensors, queue_autograd_callback
from . import external, init_context
from .external import ExternalUseDetector
from .prefetch import BACKWARD, FORWARD, Prefetcher
from .reducer import UnitGradReducer, bucket_cap
from .sharded_param import GatherStats, ShardedUnit, unit_of
from .units import UnitPlan, add_external_parameter, external_parameters, plan_units

_LIVE: "weakref.WeakSet[Stage3Coordinator]" = weakref.WeakSet()   # told about external parameters


def begin_backward_of(params: list[nn.Parameter]) -> None:
    """Start now, in the running (outer) graph task, the backward of every engine owning one of
    `params`: a node that runs nested backwards over them (tiled compute, [Note: tiled backward] in
    sequence_parallel/tiled_compute.py) must not let the first nested task start it, or its epilogue
    would run when that task ends, before the other shards."""
    units = {unit_of(p) for p in params} - {None}
    for coordinator in list(_LIVE):
        if units & coordinator._unit_set:
            coordinator._begin_backward()


def external_parameters_changed(module: nn.Module) -> None:
    """register/unregister_external_parameter after initialize: re-plan the engines holding `module`."""
    for coordinator in list(_LIVE):
        if any(m is module for m in coordinator.module.modules()):
            coordinator.replan()


class Stage3Coordinator:
    """Partitions `module`'s parameters into gather units and installs the ZeRO-3 hooks.
    `shard_device`: where shards live between uses (CPU for offload_param)."""

    def __init__(self, module: nn.Module, persistence_threshold: int = 0,
                 model_persistence_threshold: int = sys.maxsize, group: Any = None,
                 shard_device: torch.device | None = None, pin_memory: bool = False,
                 prefetch_bucket_size: int = 0, max_live_parameters: int = sys.maxsize,
                 max_reuse_distance: int = 0, reduce_bucket_size: int = 0,
                 auto_external: bool | None = None, reduce_policy: Any = None,
                 comm_dtype: torch.dtype | None = None, quantized_gradients: bool = False,
                 quantized_weights: bool = False, hpz_group: Any = None,
                 param_groups: dict[int, Any] | None = None) -> None:
        """`max_reuse_distance`/`max_live_parameters`: see [Note: keeping units for the backward];
        `reduce_bucket_size`: see [Note: ZeRO-3 reduce-scatter buckets] (0: one per unit);
        `auto_external`: see [Note: automatic external parameters] (None: from the environment);
        `reduce_policy`, `comm_dtype`: prescale/predivide and communication_data_type (reducer.py);
        `quantized_gradients`, `quantized_weights`, `hpz_group`: ZeRO++ qgZ (zero/qgz.py), qwZ
        (zero/qwz.py) and hpZ's node group (stage3/hpz.py); `param_groups`: id(parameter) -> the
        group its unit is partitioned over instead of `group` ([Note: ZeRO-3 expert units])."""
        auto_external = external.enabled_by_env() if auto_external is None else auto_external
        self.module, self.shard_device = module, shard_device
        self._keep_limit = min(max_reuse_distance, max_live_parameters)
        self._keep_budget = self._keep_limit
        self._kept: list[ShardedUnit] = []   # gathered by a forward, held for its backward
        self._thresholds = (persistence_threshold, model_persistence_threshold)
        self._param_groups = dict(param_groups or {})
        self.plan: UnitPlan = plan_units(module, *self._thresholds, numel_of=init_context.full_numel,
                                         kind_of=self._kind_of)
        named = dict(module.named_parameters())
        self.stats = GatherStats()
        self.units = []
        for spec in self.plan.units:
            params = [named[n] for n in spec.param_names]
            own = self._kind_of(params[0]) is not None   # kind_of made every parameter of the unit alike
            self.units.append(ShardedUnit(spec, params, self._param_groups[id(params[0])] if own else group,
                                          shard_device, pin_memory, self.stats))
        for unit in self.units:
            unit.configure_zeropp(quantized_weights, hpz_group if unit.group is group else None)
        self._unit_set = set(self.units)
        self.prefetcher = Prefetcher(self.units, prefetch_bucket_size, max_live_parameters)
        self.swapper: Any = None   # offload_param nvme: swap_tensor/param_swapper.py
        largest = max((u.partition.padded_numel for u in self.units if u.trainable), default=0)
        self.reducer = UnitGradReducer(group, bucket_cap(reduce_bucket_size, largest), reduce_policy, comm_dtype,
                                       quantized_gradients)
        self._by_module: set[ShardedUnit] = set()   # used by a leaf: [Note: leaf units complete by module]
        self._leaves: set[str] = set()                  # hooked modules that are z3 leaves
        self._quiet = False                             # in our hooks: the detector ignores our tensor ops
        self._calls_left: dict[ShardedUnit, int] = {}   # grad-enabled calls whose backward is pending
        self._unhooked: set[ShardedUnit] = set()        # used by a call no hook can follow: epilogue
        self._forward_depth = 0
        self._in_backward = False
        self._handles: list[Any] = []
        self._forward_handles: list[Any] = []
        self._module_units: dict[str, list[ShardedUnit]] = {}
        # one frame per running hooked module: (name, module, units acquired, units gathered for reads)
        self._frames: list[tuple[str, nn.Module, list[ShardedUnit], list[ShardedUnit]]] = []
        self._found_external = False
        self._detector = (ExternalUseDetector(self._is_released, self._unheld, self._external_use)
                          if auto_external else None)
        self._install_forward_hooks()
        _LIVE.add(self)
        # [Note: gradients for released parameters]: each trainable parameter's full shape, as a
        # zero-stride view (no memory), and the AccumulateGrad nodes made with it for one forward
        self._full_views = [(unit, unit.params[i], torch.empty((), dtype=unit.params[i].dtype,
                                                               device=unit.params[i].device).expand(unit.shapes[i]))
                            for unit in self.units if not unit.spec.persistent for i in unit.trainable]
        self._accumulators: list[Any] = []
        # The hooks hold neither the coordinator nor a unit: [Note: tensor hooks and dropped engines].
        for position, unit in enumerate(self.units):
            for i in unit.trainable:
                self._handles.append(unit.params[i].register_hook(weak_hook(self._grad_arriving, position, i)))
                hook = weak_hook(self._grad_accumulated, position, i)
                self._handles.append(unit.params[i].register_post_accumulate_grad_hook(hook))
        remove_when_collected(self, self._handles)

    def _install_forward_hooks(self) -> None:
        for handle in self._forward_handles:
            handle.remove()
        modules = dict(self.module.named_modules())
        self._forward_handles = []
        self._take_plan_uses()
        for name in {"": None, **self.plan.module_units}:   # the root always: reads are attributed to it
            m = modules[name]
            self._forward_handles.append(m.register_forward_pre_hook(partial(self._pre_forward, name), prepend=True))
            self._forward_handles.append(m.register_forward_hook(partial(self._post_forward, name), with_kwargs=True,
                                                                 always_call=True))
        # installed last: the pass begins before the root's own units are acquired, ends after their release
        self._forward_handles.append(self.module.register_forward_pre_hook(self._begin_forward, prepend=True))
        self._forward_handles.append(self.module.register_forward_hook(self._end_forward, always_call=True))

    def replan(self, hooks: bool = True) -> None:
        """Re-plan after external parameters changed (see [Note: external parameters] in
        units.py): units stay as they are, modules' hooks gather the new `uses`. `hooks=False`:
        only modules already hooked gained uses (automatic external parameters)."""
        numels = {p: n for unit in self.units for p, n in zip(unit.params, unit.spec.numels)}
        plan = plan_units(self.module, *self._thresholds, numel_of=lambda p: numels.get(p, -1), kind_of=self._kind_of)
        if plan.units != self.plan.units:
            raise RuntimeError("ZeRO-3: the model's parameters changed since deepspeed.initialize; "
                               "gather units cannot be re-planned")
        self.plan = plan
        if hooks:
            self._install_forward_hooks()
        else:
            self._take_plan_uses()

    def _kind_of(self, p: nn.Parameter) -> int | None:
        """The unit kind of `p`: its own group's id, or None (ZeRO's group)."""
        return id(self._param_groups[id(p)]) if id(p) in self._param_groups else None

    def _take_plan_uses(self) -> None:
        """The units each hooked module acquires, looked up by its hooks at each call: changing
        them needs no hook change (automatic external parameters are found mid-forward)."""
        self._module_units = {name: [self.units[u] for u in ids] for name, ids in self.plan.module_units.items()}
        modules = dict(self.module.named_modules())
        self._leaves = {name for name in self._module_units if z3_leaf_module(modules[name])}
        self._by_module = {u for name in self._leaves for u in self._module_units[name] if u.trainable}

    # --- hooks --------------------------------------------------------------------------------
    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth == 1 and self._in_backward and not in_autograd_backward():
            self.abort_backward()   # the last backward raised before its end
        if self._forward_depth == 1:
            if not self._in_backward:
                self.prefetcher.begin(FORWARD)
            if self._detector is not None:
                if torch.is_grad_enabled():
                    self._accumulators = full_shape_accumulators(self._full_views)
                self._detector.__enter__()

    def _end_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._forward_depth == 0:   # a pre-hook before ours raised: our begin never ran
            return
        self._forward_depth -= 1
        if self._forward_depth == 0:
            if self._detector is not None:
                self._detector.__exit__(None, None, None)
                self._accumulators = []   # the graph holds those it uses
            self.prefetcher.end(FORWARD)
            if self.swapper is not None:   # a failed shard read gave NaN on some rank: every rank raises
                self.swapper.check("the forward with offload_param.device nvme")
            if self._found_external:   # from the next forward, the reading modules gather them
                self._found_external = False
                self.replan(hooks=False)

    def _pre_forward(self, name: str, module: nn.Module, args: Any) -> None:
        units = self._module_units.get(name, [])
        self._frames.append((name, module, units, []))
        self._quiet = True
        try:
            for unit in units:
                unit.acquire()
                self.prefetcher.acquired(FORWARD, unit)
        finally:
            self._quiet = False

    def _is_released(self, param: nn.Parameter) -> bool:
        unit = unit_of(param)
        return unit is not None and not unit.available and not self._quiet and unit in self._unit_set

    def _unheld(self, param: nn.Parameter) -> bool:
        """Released, or gathered by no running module (GatheredParameters, a kept unit): see
        [Note: automatic external parameters]. Persistent units are never released."""
        unit = unit_of(param)
        if unit is None or self._quiet or unit.spec.persistent or unit not in self._unit_set:
            return False
        return not unit.available or not any(unit in f[2] or unit in f[3] for f in reversed(self._frames))

    def _external_use(self, param: nn.Parameter) -> None:
        """See [Note: automatic external parameters]."""
        if not self._frames:   # between the root's own hooks: nothing holds a unit there
            return
        owner, module, _, gathered = self._frames[-1]
        unit = unit_of(param)
        if owner in self._leaves:   # routing inside a leaf may differ by rank: a gather here could hang
            if unit.available:      # someone else gathered it: nothing to gather, nothing registered
                return
            raise RuntimeError(f"ZeRO-3: leaf module '{owner}' read parameter '{self._name_of(unit, param)}' of "
                               f"module '{unit.spec.owner}', which is not gathered; inside a leaf the read may happen "
                               f"on some ranks only, so it is not gathered automatically. Register it: "
                               f"deepspeed.zero.register_external_parameter(<the '{owner}' module>, <the parameter>)")
        unit.acquire()
        gathered.append(unit)
        if param not in external_parameters(module):
            add_external_parameter(module, param)
            self._found_external = True
            logger.info(f"ZeRO-3: module '{owner or '<root>'}' read parameter '{self._name_of(unit, param)}' of "
                        f"module '{unit.spec.owner}' outside that module's forward: gathered it and registered it "
                        f"as an external parameter of '{owner or '<root>'}' (register_external_parameter)")

    @staticmethod
    def _name_of(unit: ShardedUnit, param: nn.Parameter) -> str:
        return next((n for n, p in zip(unit.spec.param_names, unit.params) if p is param), "?")

    def _post_forward(self, name: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        _, _, acquired, gathered = self._pop_frame(module)
        self._quiet = True
        try:
            self._after_call(acquired + gathered, args, kwargs, output)
        finally:
            self._quiet = False

    def _pop_frame(self, module: nn.Module) -> tuple:
        """The frame `_pre_forward` pushed for this call: the top one, unless a call inside it
        raised before its own post-hook (then the innermost frame of `module`)."""
        if self._frames and self._frames[-1][1] is module:
            return self._frames.pop()
        at = [i for i, frame in enumerate(self._frames) if frame[1] is module]
        return self._frames.pop(at[-1]) if at else ("", module, [], [])   # hooked mid-call: nothing

    def _after_call(self, units: list[ShardedUnit], args: Any, kwargs: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            tensors = output_tensors(output)
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, partial(self._pre_backward, units), mode="any")
                if not self._in_backward:
                    self._keep_for_backward(units)
                by_module = [u for u in units if u in self._by_module]
                if by_module:
                    self._follow_call(by_module, output_tensors((args, kwargs)))
        for unit in reversed(units):
            unit.release()

    def _follow_call(self, units: list[ShardedUnit], inputs: list[torch.Tensor]) -> None:
        """See [Note: leaf units complete by module]."""
        if not inputs or any(t.grad_fn is None for t in inputs):
            self._unhooked.update(units)
            return
        for unit in units:
            self._calls_left[unit] = self._calls_left.get(unit, 0) + 1
        torch.autograd.graph.register_multi_grad_hook(inputs, partial(self._call_backward_done, units), mode="all")

    def _call_backward_done(self, units: list[ShardedUnit], grads: Any) -> None:
        for unit in units:
            left = self._calls_left.get(unit, 0) - 1
            if left < 0:       # its forward was before the last epilogue: that one reduced it
                continue
            self._calls_left[unit] = left
            if left == 0 and unit not in self._unhooked and unit.needs_reduce:
                self.reducer.add(unit)

    def keep_for_backward(self, enabled: bool) -> None:
        """Turn [Note: keeping units for the backward] off (an engine without an optimizer: a
        forward is not followed by a step that would give the kept units back) or on again."""
        self._keep_budget = self._keep_limit if enabled else 0

    def _keep_for_backward(self, units: list[ShardedUnit]) -> None:
        """[Note: keeping units for the backward]
        A unit released after its module's forward is gathered again before the module's
        backward: 2 all-gathers per unit per step. Like DeepSpeed (`stage3_max_reuse_distance`,
        `stage3_max_live_parameters`, both 1e9 by default), units are instead kept gathered from
        the forward to their backward while the kept elements stay within min(max_reuse_distance,
        max_live_parameters): one all-gather per unit per step for models below the budget, at
        the cost of holding them (0 keeps nothing: lowest memory). The decision depends only on
        the plan, the config and the order of modules, the same on every rank. Kept units are
        released when reduced (or at the end of the backward); a forward never followed by a
        backward gives them back at the next optimizer step (`after_shard_update`)."""
        kept = sum(u.spec.numel for u in self._kept)
        for unit in units:
            if unit.spec.persistent or unit.held or kept + unit.spec.numel > self._keep_budget:
                continue
            unit.hold_for_backward()
            self._kept.append(unit)
            kept += unit.spec.numel

    def _begin_backward(self) -> None:
        if not self._in_backward and queue_autograd_callback(self._end_backward):
            self._in_backward = True
            self.prefetcher.begin(BACKWARD)

    def _pre_backward(self, units: list[ShardedUnit], grad: Any) -> None:
        self._begin_backward()
        for unit in units:
            unit.hold_for_backward()
            self.prefetcher.acquired(BACKWARD, unit)

    def _grad_arriving(self, position: int, index: int, grad: torch.Tensor) -> None:
        """[Note: gradients for released parameters]
        A gradient can reach a parameter that no module's backward holds: one made whole by
        someone else in the forward (GatheredParameters) and released since, with the automatic
        detection off or outside the root's forward (a loss computed after it). Autograd would
        accumulate it into the 0-element placeholder: a shape error naming neither. So every
        trainable parameter has a tensor hook, run before its gradient is accumulated, that holds
        its unit for the rest of the backward, gathering it if released (a collective, reached
        at the same point of the same graph on every rank, like a module's pre-backward hook);
        it is reduced when complete, as usual. Autograd checks the gradient a node returns
        against the shape the parameter's AccumulateGrad node recorded when it was created, so
        when a grad-enabled forward of the root begins (detection on) the coordinator creates the nodes at the
        full shapes and holds them until it ends (the graph holds those it uses;
        `full_shape_accumulators`): a parameter that entered the graph while released (passed to
        `autograd.Function.apply`, gathered inside its forward) still gets its full-shape
        gradient. Held for good, the nodes would hold the parameters from C++, where the cycle
        collector cannot see them: a dropped engine's units would outlive one collection. Where gathering there
        could differ by rank, a unit of a z3 leaf module ([Note: leaf units complete by module])
        or one already reduced in this backward, the hook raises, naming the parameter and
        `register_external_parameter`."""
        unit = self.units[position]
        if unit.held or unit.spec.persistent:
            return
        if not unit.available and (unit in self._by_module or not unit.needs_reduce):
            why = ("it belongs to a z3 leaf module, whose gathers may differ by rank" if unit in self._by_module
                   else "its unit was already reduced in this backward")
            raise RuntimeError(f"ZeRO-3: a gradient arrived for parameter '{unit.spec.param_names[index]}' while it "
                               f"is released (no running module holds it; {why}). Register it on the module whose "
                               f"forward reads it: deepspeed.zero.register_external_parameter(<that module>, "
                               f"<the parameter>)")
        self._begin_backward()
        unit.hold_for_backward()

    def _grad_accumulated(self, position: int, index: int, param: nn.Parameter) -> None:
        unit = self.units[position]
        self._begin_backward()
        if not getattr(param, "ds_grad_is_ready", True):   # more nested backwards add to it: [Note: tiled backward]
            return
        if unit.grad_arrived(index) and unit not in self._by_module:
            self.reducer.add(unit)

    def _end_backward(self) -> None:
        self._in_backward = False
        self.prefetcher.end(BACKWARD)
        for unit in self.units:        # unit order: the same collectives on every rank
            if unit.needs_reduce:
                self.reducer.add(unit)
        self.reducer.flush()
        self._forget_backward(self.units)

    def abort_backward(self) -> None:
        """A backward raised before its end (an error in a checkpoint's recompute, in a hook): finish
        it as its end would have, so the next forward and backward start clean. Gradients that
        arrived are reduced into the shards, as plain PyTorch leaves a failed backward's partial
        gradients in `.grad`; zero_grad() drops them. Collective, like the end it replaces: ranks that
        hit the same error reach it alike."""
        if self._in_backward:
            self._end_backward()

    def _forget_backward(self, units: list[ShardedUnit]) -> None:
        """Drop the holds of `units` and what forwards recorded for a backward."""
        for unit in units:
            unit.end_backward()
        self._kept.clear()
        self._calls_left.clear()
        self._unhooked.clear()

    # --- API for the optimizer side ------------------------------------------------------------
    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient slices, one per unit (ceil(unit/N) elements each)."""
        return [u.grad_shard for u in self.units]

    def zero_grad(self) -> None:
        if self._in_backward:   # a backward raised before its end: forget it (nothing is reduced)
            self._in_backward = False
            self._forget_backward(self.units)
        self.reducer.discard()   # also gradients held back by coalesce_grad_reduction
        for unit in self.units:
            unit.release_grad()

    def defer_reduction(self) -> None:
        """Backwards from now on keep their gradients local until `end_deferred_reduction`."""
        self.reducer.defer()

    def end_deferred_reduction(self, reduce: bool = True) -> None:
        """Reduce-scatter what the deferred backwards accumulated (one pass, unit order), or drop it."""
        self.reducer.flush_deferred(self.units, reduce)

    def release_cache(self) -> None:
        """Release every unit that no running forward uses (upstream's empty_partition_cache):
        units kept gathered for a backward that has not come, and unused prefetches. Persistent
        units stay gathered (they are never released). The backward of a forward that ran
        before still works: its modules' units are gathered again first."""
        if self._forward_depth or self._in_backward:
            raise RuntimeError("ZeRO-3: empty_partition_cache() during a forward or backward pass")
        for unit in self.units:          # unit order: the same collectives on every rank
            unit.drop_prefetch()
        kept, self._kept = self._kept, []
        for unit in kept:
            unit.end_backward()
        for unit in self.units:
            unit.release_unused()

    def after_shard_update(self) -> None:
        """Call after changing the shards (an optimizer step): persistent units are refreshed
        now (one all-gather each); the others pick the new values up at their next gather."""
        self._forget_backward(list(self._kept))   # kept by a forward whose backward never came
        for unit in self.units:
            if unit.available and not unit.spec.persistent:
                unit.release_unused()   # gathered by the user (param.all_gather_coalesced): freed, as upstream
            if unit.available and not unit.spec.persistent:
                raise RuntimeError(f"ZeRO-3: {unit} is gathered while its shard was updated")
            unit.refresh()

    def gathered_units(self) -> list[ShardedUnit]:
        return [u for u in self.units if u.available]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter full inside the block (read-only use: writes are not scattered back)."""
        for unit in self.units:
            unit.acquire(exact=True)
        try:
            yield
        finally:
            for unit in reversed(self.units):
                unit.release()

    def full_state(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters (or fp32 averaged gradients) by name: one all-gather per unit."""
        found = {}
        for unit in self.units:
            tensors = unit.gather_full(unit.grad_shard if grads else unit.shard)
            found.update(zip(unit.spec.param_names, tensors))
        return found

    def remove(self) -> None:
        """Uninstall the hooks and give every parameter its full value back (as a plain tensor)."""
        for handle in self._handles + self._forward_handles:
            handle.remove()
        self._handles.clear()
        self._forward_handles.clear()
        _LIVE.discard(self)
        full = self.full_state()
        for unit in self.units:
            unit.disown()
            for name, p in zip(unit.spec.param_names, unit.params):
                p.data = full[name]
        if self.swapper is not None:   # its swap files go with the hooks
            self.swapper.close()



def full_shape_accumulators(full_views: list[tuple[ShardedUnit, nn.Parameter, torch.Tensor]]) -> list[Any]:
    """The AccumulateGrad node of every released parameter in `full_views` (unit, parameter, a
    full-shape view), created with the full shape: `.data` is that view for the moment. Autograd
    caches the node weakly: the caller holds it while the parameter may enter a graph."""
    nodes = []
    for unit, p, full in full_views:
        if unit.available:   # whole: a node made now or at its first use has the full shape
            continue
        placeholder = p.data
        p.data = full
        try:
            nodes.append(get_gradient_edge(p).node)
        finally:
            p.data = placeholder
    return nodes

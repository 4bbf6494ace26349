"""The memory of a compiled training step (``compile=true``), planned on the CPU without a GPU.

``torch.compile`` keeps for the backward only what Inductor's partition of the joint graph saves, and fuses
pointwise chains into kernels that never write their intermediates: the eager trace of
:mod:`models.step_cost` overstates both. Here the model's forward and loss is traced on fake tensors with AOT
autograd and Inductor's decompositions and partition function; the peak is a liveness sweep over the buffers
Inductor materializes, plus the static state. docs/plan.md lists what is modelled and what is not.

Floor: ``models/`` (imports ``models.lit`` only); :mod:`models.step_cost` calls :func:`compiled_peak`.
"""

from __future__ import annotations

import importlib.util
import operator
import sys
import types
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import FlopCounterMode

from models.lit import LitGPT


def lazy_module(name: str) -> types.ModuleType:
    """``import name``, run when an attribute is first read (importlib's LazyLoader), bound as an import
    binds it (``sys.modules`` and the parent package's attribute)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


# AOT autograd and Inductor's partition and decompositions take a second to import and only a compiled plan
# uses them: imported when one is traced, not at every start of train.py (which plans only on a GPU).
aot_autograd = lazy_module("torch._functorch.aot_autograd")
inductor_compile_fx = lazy_module("torch._inductor.compile_fx")
inductor_decomposition = lazy_module("torch._inductor.decomposition")

# Kernels Inductor calls rather than generates (cuBLAS, flash attention): they write their own outputs
# and read materialized inputs. Matched by the overload packet's name.
EXTERN = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward",
})
# Reductions and scatters: generated kernels that write a buffer of their own.
WRITES_BUFFER = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "prod", "argmax", "argmin",
    "any", "all", "cumsum", "logsumexp", "index_put", "_unsafe_index_put", "index_put_", "scatter",
    "scatter_add", "scatter_reduce", "index_add", "index_reduce", "new_zeros", "zeros", "full",
    "embedding_dense_backward", "sort", "topk",
})
# Operations that return a view of their input (no memory of their own).
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "alias", "split",
    "split_with_sizes", "unsqueeze", "squeeze", "slice", "select", "as_strided", "unbind", "chunk",
    "narrow", "view_as", "detach", "unflatten", "flatten", "diagonal",
})


@dataclass(frozen=True)
class CompiledPeak:
    """The compiled micro-step's peak over its forward and backward graphs (bytes; static state not
    included). ``saved``: what the forward keeps for the backward; at the peak, ``activations`` of it are
    alive, ``gradients`` of the new gradients and ``temporaries`` of everything else."""

    peak: int
    activations: int
    gradients: int
    temporaries: int
    saved: int
    in_backward: bool


@dataclass
class Buffer:
    size: int
    kind: str                   # activation (saved by the forward) | gradient (backward output) | temporary
    name: str = ""              # the node that writes it
    dtype: torch.dtype | None = None
    last_use: int = -1


def op_name(node: fx.Node) -> str:
    target = node.target
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def tensor_bytes(value: Any) -> int:
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def tensors_of(value: Any) -> list:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


@dataclass(frozen=True)
class Value:
    """What a node is in the sweep: the buffer holding it (None: a fused chain, not written anywhere) and
    the buffers reading it reads."""

    own: int | None
    reads: frozenset[int]


# A fused chain read by more than one kernel is written out once it reads more buffers than this
# (Inductor's ``realize_reads_threshold``, ``StorageBox.should_realize_on_reuse``).
REALIZE_READS_THRESHOLD = 4


class Sweep:
    """Liveness of the buffers of a sequence of graphs, each node a step of a global clock."""

    def __init__(self) -> None:
        self.buffers: list[Buffer] = []
        self.born: list[int] = []
        self.clock = 0
        self.forward_end = 0                        # the clock at the forward graph's end
        self.at_peak: list[Buffer] = []              # what is alive at the peak (:meth:`peak`)
        self.parts: dict[fx.Node, list[int]] = {}   # a multi-output kernel's buffers, in order
        # A fused kernel's output and the buffers of the same size and dtype it reads: written in place of
        # one that this kernel reads last (:meth:`in_place`).
        self.in_place_candidates: list[tuple[int, list[int]]] = []

    def new(self, size: int, kind: str, name: str = "", dtype: torch.dtype | None = None) -> int:
        self.buffers.append(Buffer(size, kind, name, dtype))
        self.born.append(self.clock)
        return len(self.buffers) - 1

    def use(self, ids: Iterable[int]) -> None:
        for i in ids:
            self.buffers[i].last_use = max(self.buffers[i].last_use, self.clock)

    def graph(self, graph: fx.Graph, inputs: Callable[[fx.Node], Value],
              output_kind: str) -> dict[str, Value]:
        """Walk ``graph`` (``inputs``: a placeholder's value); the outputs' values by node name, written out
        (their ``last_use`` is set by whoever reads them)."""
        values: dict[fx.Node, Value] = {}
        outputs: dict[str, Value] = {}
        for node in graph.nodes:
            self.clock += 1
            if node.op == "placeholder":
                values[node] = inputs(node)
                continue
            if node.op == "output":
                for arg in node.args[0]:
                    if isinstance(arg, fx.Node):
                        outputs[arg.name] = self.realize(arg, values, output_kind)
                continue
            if node.op != "call_function":
                continue
            name = op_name(node)
            arguments = [a for a in node.all_input_nodes if a in values]
            if name in VIEWS or name == "getitem":
                values[node] = self.view(node, values)
            elif name in EXTERN or name in WRITES_BUFFER:
                # An extern kernel reads buffers: its fused inputs are written out.
                reads = ([self.realize(a, values, "temporary") for a in arguments] if name in EXTERN
                         else [values[a] for a in arguments])
                self.use(i for value in reads for i in value.reads)
                parts = [self.new(tensor_bytes(t), "temporary", node.name, t.dtype)
                         for t in tensors_of(node.meta.get("val"))]
                values[node] = Value(parts[0] if len(parts) == 1 else None, frozenset(parts))
                self.parts[node] = parts
            else:  # pointwise: fused into whatever reads it
                reads = frozenset().union(*(values[a].reads for a in arguments))
                values[node] = Value(None, reads)
                if len(node.users) > 1 and len(reads) > REALIZE_READS_THRESHOLD:
                    self.realize(node, values, "temporary")
        return outputs

    def view(self, node: fx.Node, values: dict[fx.Node, Value]) -> Value:
        """A view aliases its base; ``getitem`` picks one output of a multi-output kernel."""
        base = node.args[0]
        if node.target is operator.getitem and base in self.parts:
            parts, index = self.parts[base], node.args[1]
            if index < len(parts):
                return Value(parts[index], frozenset({parts[index]}))
            return Value(None, frozenset())
        return values.get(base, Value(None, frozenset()))

    def realize(self, node: fx.Node, values: dict[fx.Node, Value], kind: str) -> Value:
        """``node`` written to a buffer: its own if it has one (which becomes a ``kind`` unless it is
        static), else a new one the fused chain writes now (a view: its base's chain)."""
        value = values[node]
        if value.own is not None:
            buffer = self.buffers[value.own]
            if buffer.kind == "temporary":
                buffer.kind = kind
            return value
        base = node
        while op_name(base) in VIEWS and isinstance(base.args[0], fx.Node) and values[base].own is None:
            base = base.args[0]
        self.use(value.reads)
        val = base.meta.get("val")
        own = self.new(tensor_bytes(val), kind, base.name, getattr(val, "dtype", None))
        key = (self.buffers[own].size, self.buffers[own].dtype)
        self.in_place_candidates.append((own, [
            i for i in value.reads
            if self.buffers[i].kind != "static" and (self.buffers[i].size, self.buffers[i].dtype) == key]))
        for written in {node, base}:
            values[written] = Value(own, frozenset({own}))
        return values[node]

    def in_place(self) -> None:
        """Inductor writes a fused kernel's output into a buffer of the same size and dtype that the kernel
        reads for the last time (``Scheduler``'s in-place update; the backward's saved tensors are donated
        buffers it may reuse): the output then costs nothing and the buffer lives on as the output."""
        donors: set[int] = set()
        for own, candidates in self.in_place_candidates:
            for donor in candidates:
                if donor not in donors and self.buffers[donor].last_use == self.born[own]:
                    donors.add(donor)
                    self.buffers[donor].last_use = max(self.buffers[own].last_use, self.born[own])
                    self.buffers[own].size = 0
                    break

    def peak(self) -> CompiledPeak:
        """The largest sum of live buffers over the clock, and what it holds."""
        events: dict[int, int] = {}
        for buffer, born in zip(self.buffers, self.born, strict=True):
            if buffer.kind == "static":
                continue
            end = buffer.last_use if buffer.last_use >= born else born
            events[born] = events.get(born, 0) + buffer.size
            events[end + 1] = events.get(end + 1, 0) - buffer.size
        live, best, at = 0, 0, 0
        for clock in sorted(events):
            live += events[clock]
            if live > best:
                best, at = live, clock
        self.at_peak = [b for b, born in zip(self.buffers, self.born, strict=True)
                        if b.kind != "static" and born <= at <= max(b.last_use, born)]
        by_kind = dict.fromkeys(("activation", "gradient", "temporary"), 0)
        for buffer in self.at_peak:
            by_kind[buffer.kind] += buffer.size
        saved = sum(b.size for b in self.buffers if b.kind == "activation")
        return CompiledPeak(best, by_kind["activation"], by_kind["gradient"], by_kind["temporary"], saved,
                            at > self.forward_end)


@dataclass(frozen=True)
class CompiledGraphs:
    forward: fx.GraphModule
    backward: fx.GraphModule


def trace_compiled(module: LitGPT, batch: tuple[torch.Tensor, torch.Tensor],
                   autocast: Callable[[], Any] = nullcontext) -> CompiledGraphs:
    """The forward and backward graphs Inductor would compile for ``module.model(inputs, targets)`` on the
    (fake) tensors given, partitioned as Inductor does."""
    model = module.model
    params = dict(model.named_parameters())
    graphs: dict[str, fx.GraphModule] = {}

    def keep(name: str) -> Callable:
        def compiler(gm: fx.GraphModule, _inputs: Any) -> fx.GraphModule:
            graphs[name] = gm
            return gm
        return compiler

    def step(parameters: dict, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast():
            return torch.func.functional_call(model, parameters, (inputs, targets))

    compiled = aot_autograd.aot_function(step, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                                         partition_fn=inductor_compile_fx.partition_fn,
                                         decompositions=inductor_decomposition.select_decomp_table())
    # The backward graph is made when the backward first runs (AOT autograd compiles it lazily).
    compiled(params, *batch).backward()
    return CompiledGraphs(graphs["forward"], graphs["backward"])


def graph_flops(graphs: CompiledGraphs, custom_mapping: dict | None = None) -> int:
    """FLOPs of the forward and backward graphs by ``FlopCounterMode``'s formulas (and ``custom_mapping``'s)
    on each node's shapes: what running them would count."""
    registry = FlopCounterMode(display=False, custom_mapping=custom_mapping).flop_registry
    total = 0
    for graph in (graphs.forward.graph, graphs.backward.graph):
        for node in graph.nodes:
            packet = getattr(node.target, "_overloadpacket", None)
            if node.op != "call_function" or packet not in registry:
                continue
            args, kwargs = tree_map_only(fx.Node, lambda n: n.meta.get("val"), (node.args, node.kwargs))
            total += registry[packet](*args, **kwargs, out_val=node.meta.get("val"))
    return total


def compiled_peak(graphs: CompiledGraphs) -> CompiledPeak:
    """The liveness sweep of the forward then the backward graph (module docstring)."""
    sweep = Sweep()
    # The forward's inputs (parameters, batch) are static: counted beside the graphs.
    static = sweep.new(0, "static")
    saved = sweep.graph(graphs.forward.graph, lambda node: Value(static, frozenset({static})), "activation")
    sweep.forward_end = sweep.clock
    # The backward's placeholders are named after the forward's outputs they take (the saved tensors);
    # the others are the loss's gradient (a scalar).
    sweep.graph(graphs.backward.graph, lambda node: saved.get(node.name, Value(None, frozenset())),
                "gradient")
    sweep.clock += 1
    for i, buffer in enumerate(sweep.buffers):  # the gradients outlive the backward graph
        if buffer.kind == "gradient":
            sweep.use([i])
    sweep.in_place()
    return sweep.peak()

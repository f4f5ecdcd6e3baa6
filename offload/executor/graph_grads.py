"""The weight gradients accumulated inside a compiled backward, as the eager engine accumulates them.

A compiled backward (AOTAutograd) hands every weight gradient back as an output of its
graph: each is held from the op that makes it to the graph's end, and only then does
autograd's engine add it into ``.grad``.  Where the gradients are zeroed in place between
steps (the profile's default, counted in ``base_bytes``), the step so held a second copy of
every gradient; where they are freed (``set_to_none``), each was still held from its op to
the end, as the eager step holds it once it is ``.grad``, and then copied, where the eager
engine takes it as it is.  A GPT compiled whole had its smallest budget at 63.7% of its
peak, 34.7% with its gradients accumulated here, where the eager model's is at 30.9%
(``experiments/results/README.md``, twenty-second session).

``compile_scheduled``'s partitioner therefore ends the backward graph's life of each weight
gradient where it is made (``add_accumulation``):

* ``offload::params(number, params)``, at the forward graph's start, hands the weights (the
  graph's inputs whose gradients the backward makes, AOTAutograd's static inputs: the module's
  parameters) to the module's ``GraphGrads``;
* ``offload::accumulate(grad, number, index)``, right after the node that makes a weight's
  gradient, adds it into that weight's ``.grad`` as the engine's ``AccumulateGrad`` would:
  ``grad.add_(g)`` where ``.grad`` is kept (the same kernel, the same bits), ``g`` itself
  (or a copy in the weight's layout) where it is ``None``;
* the graph then returns ``None`` for that weight, so the engine accumulates nothing twice.

What the engine would do otherwise is refused where this cannot do it: ``torch.autograd.grad``
(which returns gradients instead of accumulating them; the engine says so when asked whether
it will run the weight's ``AccumulateGrad``), and a weight with a hook on its gradient (the
engine runs those; the graph would skip them).  ``backward(inputs=...)`` accumulates only
into the weights it names, as the engine does.  The engine still runs each weight's
``AccumulateGrad`` node, with no gradient, after the graph: hooks on that node (where
``DistributedDataParallel``'s reducer reads ``.grad``) see it accumulated.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Sequence

import torch
from torch import fx
from torch.fx import has_side_effect

_LIB = torch.library.Library("offload", "FRAGMENT")
_LIB.define("params(int grads, Tensor[] params) -> ()")
_LIB.define("accumulate(Tensor grad, int grads, int index) -> ()")
PARAMS_OP = torch.ops.offload.params.default
ACCUMULATE_OP = torch.ops.offload.accumulate.default
GRAD_OPS = (PARAMS_OP, ACCUMULATE_OP)

_ALL: "weakref.WeakValueDictionary[int, GraphGrads]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count(1)


class GraphGrads:
    """The weights of one compiled module, and what accumulates their gradients in its backward.

    Its number, in the graphs' ops, is one of this process (as ``GraphCopies``'s).  ``steal``,
    set by ``compiled.compile_with`` for the compiler it uses: whether a gradient may become
    ``.grad`` itself where that is ``None`` (the graph frees its buffers when their last reader
    is done and reuses none: under aot_eager, or Inductor without buffer reuse and CUDA
    graphs); otherwise it is copied.
    """

    def __init__(self) -> None:
        self.number = next(_NUMBERS)
        self.steal = False
        self.params: Sequence[torch.Tensor] = ()  # the last forward's, in the graph's order
        self.accumulated = 0  # gradients accumulated so far, every step
        self._task = -1  # the engine's graph task that ``_nodes`` is of
        self._nodes: dict[int, object] = {}
        _ALL[self.number] = self

    def _accumulators(self) -> dict[int, object]:
        """The engine's ``AccumulateGrad`` node of each weight, by the weight's ``id``, where
        the engine runs the backward graph (the node it runs it in leads to them; nothing where
        the graph is run by hand), read once a backward."""
        task = torch._C._current_graph_task_id()
        if task != self._task:
            running = torch._C._current_autograd_node()
            self._task = task
            self._nodes = {} if running is None else {
                id(n.variable): n for n, _ in running.next_functions if hasattr(n, "variable")}
        return self._nodes

    def accumulate(self, grad: torch.Tensor, index: int) -> None:
        param = self.params[index]
        if param._backward_hooks or param._post_accumulate_grad_hooks:
            raise RuntimeError(f"a weight of the compiled graph ({tuple(param.shape)}, {param.dtype}) has a hook on its "
                               "gradient: compile_scheduled accumulates the weight gradients into .grad inside its "
                               "backward graph, where the engine's hooks do not run; register the hook on a module's "
                               "output instead, or train the module with Offloaded")
        node = self._accumulators().get(id(param))
        try:
            if node is not None and not torch._C._will_engine_execute_node(node):
                return  # backward(inputs=...) without this weight: the engine would not accumulate it either
        except RuntimeError as e:  # the engine says so for torch.autograd.grad
            raise RuntimeError("compile_scheduled accumulates the weight gradients into .grad inside its backward "
                               "graph, so torch.autograd.grad cannot return them: call .backward() on the loss, "
                               "or compile the module with torch.compile alone") from e
        if grad.dtype != param.dtype:
            grad = grad.to(param.dtype)
        if param.grad is not None:
            param.grad.add_(grad)
        elif self.steal and grad.stride() == param.stride() and grad.storage_offset() == 0 and (
                grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()):
            param.grad = grad
        else:
            param.grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
        self.accumulated += 1


def grads(number: int) -> GraphGrads:
    return _ALL[number]


@torch.library.impl(_LIB, "params", "CompositeExplicitAutograd")
def _params(number: int, params: list[torch.Tensor]) -> None:
    grads(number).params = params


@torch.library.impl(_LIB, "accumulate", "CompositeExplicitAutograd")
def _accumulate(grad: torch.Tensor, number: int, index: int) -> None:
    grads(number).accumulate(grad, index)


@torch.library.register_fake("offload::params", lib=_LIB)
def _params_fake(number: int, params: list[torch.Tensor]) -> None:
    return None


@torch.library.register_fake("offload::accumulate", lib=_LIB)
def _accumulate_fake(grad: torch.Tensor, number: int, index: int) -> None:
    return None


for _op in GRAD_OPS:
    has_side_effect(_op)


def add_accumulation(forward: fx.GraphModule, backward: fx.GraphModule, weights: Sequence[int],
                     runtime: GraphGrads) -> int:
    """Put the accumulation of the weights' gradients into the partitioned graphs (module docstring).

    Args:
        forward, backward: AOTAutograd's partitioned graphs; the backward's outputs are the
            gradients of the forward's inputs, in order.
        weights: the inputs that are the module's weights (AOTAutograd's
            ``static_lifetime_input_indices``: parameters and buffers; those with a gradient
            are the parameters).
        runtime: what the ops name by its number.

    Returns:
        How many weights' gradients the backward now accumulates itself.
    """
    inputs = forward.graph.find_nodes(op="placeholder")
    output = backward.graph.find_nodes(op="output")[0]
    returned = list(output.args[0])
    taken = [i for i in weights if i < len(returned) and isinstance(returned[i], fx.Node)
             and returned[i].op != "placeholder"]
    if not taken:
        return 0
    with forward.graph.inserting_after(inputs[-1]):
        forward.graph.call_function(PARAMS_OP, (runtime.number, [inputs[i] for i in taken]))
    for index, i in enumerate(taken):
        grad = returned[i]
        with backward.graph.inserting_after(grad):
            backward.graph.call_function(ACCUMULATE_OP, (grad, runtime.number, index))
        returned[i] = None
    output.args = (tuple(returned),)
    for graph in (forward, backward):
        graph.graph.lint()
        graph.recompile()
    return len(taken)

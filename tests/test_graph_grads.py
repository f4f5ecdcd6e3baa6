"""The weight gradients accumulated inside ``compile_scheduled``'s backward graph
(``offload.executor.graph_grads``): each added into ``.grad`` where the graph makes it, as
autograd's engine would add it after the graph, bit for bit; what the engine would do
otherwise refused or followed."""
import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from offload.executor.compiled import compile_scheduled, plain_compile
from offload.executor.graph_grads import ACCUMULATE_OP
from offload.core.meters import allocated_peak
from offload.models import resolve
from offload.profiler.profile import ProfileOptions, profile
from offload.step.memory import floor_offloads
from offload.step.schedule import make_schedule

GPT = {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 64, "dropout": 0.1}


@pytest.fixture(scope="module")
def chain():
    return profile("gpt", ProfileOptions(batch=2, repeats=1, warmup=1, encodings=False, options=GPT)).chain


def steps(make, set_to_none):
    """Two micro-batches' backward into the same gradients (freed or zeroed first), the
    module ``make`` returns, same weights and dropout draws each time."""
    torch._dynamo.reset()
    torch.manual_seed(1)
    spec = resolve("gpt", 2, GPT)
    run = make(spec.module)
    for p in spec.module.parameters():
        p.grad = None if set_to_none else torch.zeros_like(p)
    torch.manual_seed(0)
    for _ in range(2):
        spec.loss(run(*spec.args)).backward()
    return run, spec.module


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_the_backward_graph_accumulates_each_weight_gradient_where_it_makes_it(chain, backend, set_to_none):
    """Every weight's gradient goes into ``.grad`` by an op right after the node that makes
    it, the graph returns none to the engine, and the gradients after two backward passes
    are plain compile's bit for bit, whether ``.grad`` was zeroed in place or freed (then the
    first pass's gradient becomes it: taken as it is where the graph reuses no buffer, under
    aot_eager and with our copies under Inductor, else copied in the weight's layout)."""
    schedule = make_schedule(chain, floor_offloads(chain)[:1])  # our copies: Inductor reuses no buffer
    ours, module = steps(lambda m: compile_scheduled(m, chain, schedule, backend=backend), set_to_none)
    _, reference = steps(lambda m: plain_compile(m, backend), set_to_none)
    p = ours.partitioner
    weights = [w for w in module.parameters() if w.requires_grad]
    assert p.accumulated == len(weights) and p.grads.steal
    assert p.grads.accumulated == 2 * len(weights)
    forward, backward = p.graphs
    assert all(g is None for g in backward.graph.find_nodes(op="output")[0].args[0])
    for op in backward.graph.find_nodes(op="call_function", target=ACCUMULATE_OP):
        assert op.prev is op.args[0]  # right where the gradient is made
    for mine, theirs in zip(module.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, theirs.grad)


def test_the_backward_holds_no_weight_gradient_to_its_end(chain):
    """With the gradients zeroed in place (kept between steps), plain compile's backward holds
    a second copy of every weight gradient by its end, ours about one at a time."""
    schedule = make_schedule(chain, [])
    peaks = {}
    for way, make in (("ours", lambda m: compile_scheduled(m, chain, schedule, backend="aot_eager")),
                      ("plain", lambda m: plain_compile(m, "aot_eager"))):
        run, module = steps(make, set_to_none=False)  # compiled, the gradients made
        spec = resolve("gpt", 2, GPT)
        loss = spec.loss(run(*spec.args))
        peaks[way] = allocated_peak(loss.backward, torch.device("cpu"))
    weights = sum(w.numel() * w.element_size() for w in module.parameters())
    assert peaks["plain"] > weights and peaks["plain"] - peaks["ours"] > weights // 2, (peaks, weights)


def test_what_the_engine_would_do_otherwise_is_followed_or_refused(chain):
    """``backward(inputs=...)`` accumulates only what it names, as the engine; a hook on the
    engine's accumulation node (DistributedDataParallel's reducer has one on every weight) runs
    after the graph, reading ``.grad`` accumulated; ``autograd.grad``, which returns gradients
    instead, and a hook on a weight's gradient, which the engine would run, are refused with
    what to do."""
    torch._dynamo.reset()
    spec = resolve("gpt", 2, GPT)
    run = compile_scheduled(spec.module, chain, make_schedule(chain, []), backend="aot_eager")
    head = next(spec.module.parameters())
    seen = []  # what DistributedDataParallel's reducer reads in its hook on the accumulation node
    accumulation = get_gradient_edge(head).node  # held: the weight holds it weakly
    accumulation.register_hook(lambda grads_in, grads_out: seen.append(head.grad.clone()))
    loss = spec.loss(run(*spec.args))
    loss.backward(inputs=[head])
    assert len(seen) == 1 and torch.equal(seen[0], head.grad)  # run after the graph, .grad accumulated
    assert head.grad is not None and all(w.grad is None for w in list(spec.module.parameters())[1:])
    with pytest.raises(RuntimeError, match="torch.autograd.grad cannot return them"):
        torch.autograd.grad(spec.loss(run(*spec.args)), [head])
    head.register_hook(lambda g: g * 2)
    with pytest.raises(RuntimeError, match="has a hook on its gradient"):
        spec.loss(run(*spec.args)).backward()

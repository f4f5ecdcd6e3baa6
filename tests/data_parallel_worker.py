"""One rank of a data-parallel run, started by ``torch.distributed.run`` from test_stacks.py.

Usage: ``python -m torch.distributed.run --nproc_per_node=2 tests/data_parallel_worker.py
MODES CHAIN SCHEDULE OUT [DEVICE]`` (``cpu``, the default: gloo and the cpu-lazy backend;
``cuda``: NCCL, each rank on its own GPU, the CUDA backend) with MODES a comma-separated list of ``ddp`` (``DDP(Offloaded(m))``), ``ddp-inside``
(``Offloaded(DDP(m))``) or ``fsdp2`` (``fully_shard`` on each stage's module and the root,
then ``Offloaded``).  Each rank trains the chain's model 3 steps on its own batch with the
schedule, and the same model the same way without offloading; after every step each
rank's gradients (its shards, under FSDP2) and the updated weights must be equal bit for
bit.  Rank 0 writes a JSON summary per mode to OUT.
"""
from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from offload import Offloaded
from offload.core.staging import Site
from offload.executor.distributed import finish, own_batch, start
from offload.models import resolve
from offload.step.chainfile import load_chain
from offload.step.schedulefile import load_schedule


def local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of this rank's data (a DTensor's shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def build(chain, schedule, mode: str, offload: bool, device: torch.device):
    r = chain.recipe
    spec = resolve(r.model, r.batch, dict(r.options), r.seed)
    spec.place(device, getattr(torch, r.dtype))
    m = spec.module
    backend = "cuda" if device.type == "cuda" else "cpu-lazy"
    if mode == "fsdp2":  # every stage's module that has weights, then the root
        modules = dict(m.named_modules())
        for site in dict.fromkeys(Site.parse(c).module for c in r.cuts):
            if any(True for _ in modules[site].parameters()):
                fully_shard(modules[site])
        fully_shard(m)
        run = Offloaded(m, chain, schedule, backend=backend) if offload else m
    elif mode == "ddp":
        run = DDP(Offloaded(m, chain, schedule, backend=backend)) if offload else DDP(m)
    else:  # ddp-inside
        run = Offloaded(DDP(m), chain, schedule, backend=backend) if offload else DDP(m)
    return spec, m, run


def compare(mode: str, chain, schedule, rank: int, device: torch.device) -> dict:
    """3 steps with and without offloading under ``mode``: the summary rank 0 reports."""
    spec, mine, ours = build(chain, schedule, mode, offload=True, device=device)
    _, plain, theirs = build(chain, schedule, mode, offload=False, device=device)
    opt_ours = torch.optim.SGD(mine.parameters(), lr=0.05)
    opt_theirs = torch.optim.SGD(plain.parameters(), lr=0.05)
    mismatches, steps = 0, 3
    for step in range(steps):
        args, kwargs = own_batch(spec.args, spec.kwargs)
        for run, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            torch.manual_seed(1000 * rank + step)  # the same dropout draws in both
            spec.loss(run(*args, **kwargs)).backward()
        for a, b in zip(mine.parameters(), plain.parameters()):
            mismatches += not torch.equal(local(a.grad), local(b.grad))
        opt_ours.step(), opt_theirs.step()
        opt_ours.zero_grad(set_to_none=False), opt_theirs.zero_grad(set_to_none=False)
        for a, b in zip(mine.parameters(), plain.parameters()):
            mismatches += not torch.equal(local(a), local(b))
    # the ranks trained on different data, so without the all-reduce their weights would differ
    first = torch.cat([local(p).detach().flatten() for p in mine.parameters()])
    gathered = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, first)
    same_across = mode == "fsdp2" or all(torch.equal(g, gathered[0]) for g in gathered)
    totals = torch.tensor([mismatches, int(not same_across)], device=device)
    dist.all_reduce(totals)
    moved = ours.module.moved_bytes if isinstance(ours, DDP) else ours.moved_bytes
    return {"ranks": dist.get_world_size(), "steps": steps, "mismatches": int(totals[0]),
            "ranks_disagree": int(totals[1]), "d2h_bytes": moved[0], "h2d_bytes": moved[1]}


def main(modes: str, chain_path: str, schedule_path: str, out: str, device_type: str = "cpu") -> None:
    chain = load_chain(chain_path)
    device = start(torch.device(device_type))  # gloo, or NCCL on this rank's GPU
    rank = dist.get_rank()
    schedule = load_schedule(schedule_path, chain)
    summary = {mode: compare(mode, chain, schedule, rank, device) for mode in modes.split(",")}
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(summary, fh)
    finish(0)  # after a barrier, at once: freeing the DDP reducer and the gloo group can hang


if __name__ == "__main__":
    main(*sys.argv[1:6])

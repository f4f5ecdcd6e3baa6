"""The algorithms that choose a schedule for the model of ``offload.step``: an exact MILP
(``ilp``, on ``pulp_backend``; window by window on long chains, ``lns``), relaxation
heuristics (``relax``, on the fluid LP of ``bounds``), the timing rules (``policy``), the
literature's baselines (``baselines``, ``checkpointing``), the smallest budgets
(``encoded_floor``, ``floors``), all behind one call: ``methods.solve``.  Pure Python (pulp,
networkx, numpy): never imports torch.

Typical use::

    from offload import Budget, load_chain, solve
    chain = load_chain("chain.json")
    result = solve(chain, Budget.parse("60%", chain), method="ilp")
    print(result.status, result.simulation.makespan_s, result.gap)
"""

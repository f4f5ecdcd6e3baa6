"""A U-Net's skips restored on a real GPU (held parts, session 9): profile, solve at the floor, train checked."""
import json, sys, torch
from offload.profiler.profile import ProfileOptions, profile
from offload.step.memory import smallest_feasible_budget, no_offload_peak
from offload.solver.methods import Options, solve
from offload.executor.train import TrainOptions, train

dev = "cuda" if torch.cuda.is_available() else "cpu"
opts = dict(width=64, depth=3, image=256) if dev == "cuda" else dict(width=16, depth=3, image=64)
chain = profile("tests/models/unet.py:build", ProfileOptions(batch=8 if dev == "cuda" else 4, device=dev, repeats=2,
                                                              options=opts)).chain
print("restorable", sorted(chain.restorable))
floor, peak = smallest_feasible_budget(chain), no_offload_peak(chain)
print(f"peak {peak} floor {floor} ({floor / peak:.1%}) workspace {chain.workspace_bytes}")
for share in (None, 0.45):
    budget = floor if share is None else max(floor, int(share * peak))
    res = solve(chain, budget, "relax-lp", Options())
    restores = [(o.stage, o.release, o.restore) for o in res.schedule.offloads if o.restore]
    print(f"budget {budget} ({budget / peak:.1%}): restores {restores}")
    for check in (False, True):
        rep, err = train(None, chain, res.schedule, TrainOptions(steps=4, device=dev, op_memory=True, check_grads=check))
        j = rep.json()
        out = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
        json.dump(j, open(f"{out}/unet-{len(restores)}-{int(check)}.json", "w"), default=str)
        m, p = j["measured"], j["predicted"]
        over = {k: v - p["op_peak_bytes"][k] for k, v in (m.get("op_peak_bytes") or {}).items()
                if k in (p.get("op_peak_bytes") or {}) and v > p["op_peak_bytes"][k]}
        print(f"  check={check} error={err} step {m['step_s']:.4f} / pred {p['step_s']:.4f}; peak "
              f"{m['activation_peak_bytes']} / pred {p['activation_peak_bytes']} budget {budget}; "
              f"d2h {m['d2h_bytes_per_step']} h2d {m['h2d_bytes_per_step']}; grads {j.get('grads_match')} "
              f"noise {j.get('grads_within_noise')}; ops over {over}", flush=True)

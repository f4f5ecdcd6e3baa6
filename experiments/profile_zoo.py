"""Profile the zoo's reference models into ``experiments/chains/`` (the solver benchmarks' data).

On a GPU (the reference set, realistic sizes)::

    python -m experiments.profile_zoo --device cuda

writes ``experiments/chains/<model>-b<batch>[-<image>px]-<device>.json`` for ResNet-50/101/152 and
DenseNet-121 at 224x224 (batch 64), the GPT decoder and transformers' GPT-2 (GPT-2 small,
sequence 1024, batch 8), Llama and BERT (batch 8, sequence 1024 and 512) and ViT-B/16 (batch
32), each chain recording the device and command that made it.  ``--set small``
profiles reduced sizes that a CPU finishes in minutes (clearly named ``-cpu``); ``tiny`` is
for tests.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tqdm import tqdm

from offload.core.devices import pick_device
from offload.profiler.profile import ProfileOptions, profile
from offload.step.chainfile import save_chain

CHAINS = Path(__file__).parent / "chains"

# (model, batch, options)
SETS = {
    "reference": [
        ("resnet50", 64, {"image": 224}),
        ("resnet101", 64, {"image": 224}),
        ("resnet152", 64, {"image": 224}),
        ("densenet121", 64, {"image": 224}),
        ("gpt", 8, {"layers": 12, "width": 768, "heads": 12, "seq": 1024}),
        ("gpt2", 8, {"layers": 12, "width": 768, "heads": 12, "seq": 1024, "vocab": 50257}),
        ("llama", 8, {"layers": 16, "width": 2048, "heads": 32, "kv_heads": 8, "seq": 1024, "vocab": 32000}),
        ("bert", 8, {"layers": 12, "width": 768, "heads": 12, "seq": 512, "vocab": 30522}),
        ("vit", 32, {"layers": 12, "width": 768, "heads": 12, "image": 224, "patch": 16, "classes": 1000}),
    ],
    "small": [
        ("resnet50", 8, {"image": 128}),
        ("resnet101", 4, {"image": 128}),
        ("densenet121", 4, {"image": 128}),
        ("inception", 8, {"image": 128}),
        ("vgg16", 4, {"image": 128}),
        ("gpt", 2, {"layers": 6, "width": 384, "heads": 6, "seq": 256, "vocab": 8192}),
        ("gpt2", 4, {"layers": 8, "width": 128, "heads": 4, "seq": 256, "vocab": 512}),
        ("llama", 4, {"layers": 8, "width": 128, "heads": 4, "kv_heads": 2, "seq": 256, "vocab": 512}),
        ("bert", 4, {"layers": 6, "width": 128, "heads": 4, "seq": 256, "vocab": 512}),
        ("vit", 4, {"layers": 8, "width": 96, "heads": 3, "image": 64, "patch": 4}),
    ],
    "tiny": [  # seconds on a CPU: the tests of the experiment scripts
        ("resnet18", 2, {"image": 32}),
        ("gpt", 2, {"layers": 2, "width": 32, "heads": 4, "seq": 16, "vocab": 50}),
    ],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--set", choices=list(SETS), default="reference")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", nargs="*", help="profile only these models of the set")
    ap.add_argument("--out", type=Path, default=CHAINS, help=f"where to write the chains (default {CHAINS})")
    args = ap.parse_args(argv)
    device = pick_device(args.device)
    todo = [m for m in SETS[args.set] if not args.only or m[0] in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    for model, batch, options in tqdm(todo, desc="zoo", unit="model", file=sys.stderr):
        opts = ProfileOptions(batch=batch, device=str(device), dtype=args.dtype, repeats=args.repeats, options=options)
        result = profile(model, opts)
        chain = result.chain
        command = ["offload", "profile", model, "--batch", str(batch), "--device", device.type, "--dtype", args.dtype,
                   "--repeats", str(args.repeats)] + [a for k, v in options.items() for a in ("-O", f"{k}={v}")]
        chain.source["command"] = shlex.join(command)
        size = f"-{options['image']}px" if "image" in options else ""
        path = args.out / f"{model}-b{batch}{size}-{device.type}.json"
        save_chain(chain, path)
        peak = max(s.fwd_peak_bytes for s in chain.stages)
        print(f"{path}: {chain.L} stages, step {chain.ideal_makespan_s:.3f} s, "
              f"saved {sum(s.saved_bytes for s in chain.stages) / 2**30:.2f} GiB, largest fwd peak {peak / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

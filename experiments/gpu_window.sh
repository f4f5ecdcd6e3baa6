#!/bin/bash
# One device window (`make gpu-window`): what is still to be measured on a GPU, each part under
# its own limit and the whole under WINDOW_S seconds (560), the next part run whatever the last
# one did.  Usage: experiments/gpu_window.sh RESULTS [PYTHON]
#
# 0. machine.txt: the versions, and whether every module of the package imports on the machine's
#    torch (none did on torch 2.11 from 2026-11-29 to 2026-12-07);
# 1. the compiled path's GPU tests (#35; a segfault of its copies on CUDA fixed on the CPU since
#    the last window), each test under its own limit so that a hang fails it and the run goes on;
# 2. the bf16 Llama profiled again (its chain now carries the host's time per handled tensor,
#    handle_host_s, #33) and trained at 30% of its peak, joint and per-block checkpointing: the
#    rows that ran +8.9% and +10.2% over their predictions in the fourth H200 session;
# 3. the executor's pack and unpack hooks timed call by call on that host, kept and handled;
# 4. the compiled benchmark under faulthandler (where it crashes, the stack says where);
# 5. a ResNet-18's encodings, profiled on the GPU (their ops' memory now measured with them on,
#    offload/profiler/encoded_memory.py) and trained every unit encoded (Gist's rule) with
#    --op-memory: is each op at its prediction on CUDA too;
# 6. the other GPU tests.
# RESULTS gets at most 8 files (what a device run brings back): machine.txt, log.txt, the two
# test logs and bench.tgz (every benchmark's folder and log, packed after each part).
set -u
R=${1:?usage: experiments/gpu_window.sh RESULTS [PYTHON]}
PY=${2:-python3}
W=$(mktemp -d)
mkdir -p "$R"
export PYTHONUNBUFFERED=1
T0=$(date +%s); END=$(( T0 + ${WINDOW_S:-560} ))
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$R/log.txt"; }
left() { local l=$(( END - $(date +%s) )); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
pack() { (cd "$W" && tar czf "$R/bench.tgz" --exclude='*-trace.json' .); }
PER_TEST=$($PY -c "import pytest_timeout" 2>/dev/null && echo "--timeout 60")
PYTEST="$PY -m pytest -v -rf -p no:cacheprovider --tb=short $PER_TEST"

{ nvidia-smi -L; $PY -c "import torch, transformers, pulp; print(torch.__version__, torch.version.cuda, transformers.__version__, pulp.__version__)"; $PY -c "import importlib, pkgutil, offload; [importlib.import_module(m.name) for m in pkgutil.walk_packages(offload.__path__, 'offload.') if not m.name.endswith('__main__')]; print('every module of offload imports')"; git log -1 --format=%H; } > "$R/machine.txt" 2>&1

el compiled-tests
timeout "$(left 120)" $PYTEST -m "gpu or cudashim" -k compiled tests/test_executor_gpu.py tests/test_cudashim.py > "$R/tests-compiled.txt" 2>&1
echo "rc $?" >> "$R/tests-compiled.txt"

el bf16
timeout "$(left 210)" $PY -m experiments.bench_executor --models llama-bfloat16 --out "$W/bf16" \
    --ways joint checkpoint --shares 0.3 --repeats 2 --steps 5 --time-limit 15 > "$W/bf16.log" 2>&1
echo "rc $?" >> "$W/bf16.log"; pack

el hooks
timeout "$(left 40)" $PY -m experiments.bench_overhead --hooks --model llama --steps 10 > "$W/hooks.txt" 2>&1
echo "rc $?" >> "$W/hooks.txt"; pack

el compiled
timeout "$(left 100)" $PY -X faulthandler -m experiments.compiled --model llama --layers 4 --width 1024 --batch 8 \
    --steps 5 --out "$W/compiled" > "$W/compiled.log" 2>&1
echo "rc $?" >> "$W/compiled.log"; pack

el encodings
mkdir -p "$W/encodings"
timeout "$(left 60)" bash -c "$PY -m offload profile resnet18 --batch 8 -O image=64 --device cuda -q \
    -o $W/encodings/chain.json && $PY -m offload solve $W/encodings/chain.json --budget 150% -m gist \
    -o $W/encodings/schedule.json && $PY -m offload train --chain $W/encodings/chain.json \
    --schedule $W/encodings/schedule.json --steps 3 --check-grads --op-memory --report $W/encodings/report.json" \
    > "$W/encodings.log" 2>&1
echo "rc $?" >> "$W/encodings.log"; pack

el tests
timeout "$(left 150)" $PYTEST -m "gpu or cudashim" -k "not compiled" tests/test_executor_gpu.py tests/test_cudashim.py \
    > "$R/tests.txt" 2>&1
echo "rc $?" >> "$R/tests.txt"
pack; el done
tail -n 3 "$R/tests-compiled.txt" "$R/tests.txt"

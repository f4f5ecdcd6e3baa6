#!/bin/bash
# thirteenth session, one device call: make gpu-window's parts (copies' host time, the GPU tests,
# ResNet-50 joint/offload at 50%, the bf16 Llama joint/checkpoint at 30%), then #35's compiled path
[ -n "$DRY" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p $R /tmp/b
nvidia-smi -L > $R/machine.txt; python3 -c "import torch, transformers, pulp, highspy; print(torch.__version__, torch.version.cuda, transformers.__version__, pulp.__version__)" >> $R/machine.txt 2>&1
T0=$(date +%s); END=$(( T0 + ${TOTAL:-555} ))
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - $(date +%s) )); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
pack() { (cd /tmp/b && tar czf $R/bench.tgz --exclude='*-trace.json' . ); }
W="--repeats 2 --steps 5 --time-limit 15"
el copies; timeout $(left 40) python3 -m experiments.bench_overhead --copies > /tmp/b/copies.txt 2>&1; echo rc $? >> /tmp/b/copies.txt; pack
el tests; timeout $(left 150) python3 -m pytest -v -rf -p no:cacheprovider --tb=line -m "gpu or cudashim" tests/test_executor_gpu.py tests/test_cudashim.py > $R/tests.txt 2>&1; echo rc $? >> $R/tests.txt
el r50; timeout $(left 110) python3 -m experiments.bench_executor --models resnet50 --ways joint offload --shares 0.5 $W --out /tmp/b/r50 > /tmp/b/r50.log 2>&1; echo rc $? >> /tmp/b/r50.log
gzip -c /tmp/b/r50/resnet50-50-joint-trace.json > $R/r50-joint-trace.json.gz 2>/dev/null; pack
el bf16; timeout $(left 200) python3 -m experiments.bench_executor --models llama-bfloat16 --ways joint checkpoint --shares 0.3 $W --out /tmp/b/bf16 > /tmp/b/bf16.log 2>&1; echo rc $? >> /tmp/b/bf16.log
gzip -c /tmp/b/bf16/llama-bfloat16-30-joint-trace.json > $R/bf16-joint-trace.json.gz 2>/dev/null; pack
el compiled; timeout $(left 200) python3 -m experiments.compiled --model llama --layers 4 --width 1024 --batch 8 --steps 5 --out /tmp/b/compiled > /tmp/b/compiled.log 2>&1; echo rc $? >> /tmp/b/compiled.log
pack; el done

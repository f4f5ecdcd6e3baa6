#!/bin/bash
# tenth session, one device call: #33's bf16 Llama on fresh profiles, the GPU tests, ResNet-50's joint row, #35 on CUDA
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
R=${OUT:-/tmp/out}; mkdir -p $R /tmp/b
nvidia-smi -L > $R/machine.txt; python3 -c "import torch, transformers, pulp; print(torch.__version__, torch.version.cuda, transformers.__version__, pulp.__version__)" >> $R/machine.txt 2>&1
git log -1 --format=%H >> $R/machine.txt 2>/dev/null
T0=$(date +%s); END=$(( T0 + ${TOTAL:-560} ))
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a $R/log.txt; }
left() { local l=$(( END - $(date +%s) )); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }
pack() { (cd /tmp/b && tar czf $R/bench.tgz --exclude='*-trace.json' . ); }
BF="--models llama-bfloat16 --repeats 2 --steps 5 --time-limit 15 --out /tmp/b/bf16"
el bf16-a; timeout $(left 200) python3 -m experiments.bench_executor $BF --ways joint checkpoint --shares 0.3 > /tmp/b/bf16-a.log 2>&1; echo rc $? >> /tmp/b/bf16-a.log; pack
el tests; timeout $(left 130) python3 -m pytest -q -p no:cacheprovider -m "gpu or cudashim" tests/test_executor_gpu.py tests/test_cudashim.py --timeout 90 > $R/tests.txt 2>&1; echo rc $? >> $R/tests.txt
el unet; timeout $(left 60) python3 .whl/gpu_unet.py $R > $R/unet.txt 2>&1; echo rc $? >> $R/unet.txt
el bf16-b; timeout $(left 80) python3 -m experiments.bench_executor $BF --resume --ways joint --shares 0.2 0.5 0.7 > /tmp/b/bf16-b.log 2>&1; echo rc $? >> /tmp/b/bf16-b.log; pack
el r50; timeout $(left 80) python3 -m experiments.bench_executor --models resnet50 --ways joint --shares 0.5 --repeats 2 --steps 5 --time-limit 15 --out /tmp/b/r50 > /tmp/b/r50.log 2>&1; echo rc $? >> /tmp/b/r50.log
gzip -c /tmp/b/r50/resnet50-50-joint-trace.json > $R/r50-joint-trace.json.gz 2>/dev/null; pack
el compiled; timeout $(left 200) python3 -m experiments.compiled --model llama --layers 4 --width 1024 --batch 8 --steps 5 --out /tmp/b/compiled > /tmp/b/compiled.log 2>&1; echo rc $? >> /tmp/b/compiled.log
pack; el done

#!/usr/bin/env bash
# The GPU check, one prepared run where a CUDA GPU is lent (docs/benchmarks.md records each run with the
# card's name). Run from the repository root: `bash scripts/gpu_check.sh`; logs and JSON go to $OUT.
#
# 1. Every CUDA test: the engine on the GPU against the CPU reference (tests/test_cuda.py), bf16 against
#    HF, NIXL between GPU memories of two processes, PD and DualPath (PE/DE read paths, store) with KV
#    on the GPU (the `cuda-*` parameters of the e2e tests).
# 2. `pdserve bench offline` on the GPU (pdserve vs HF generate, same requests), bf16: a ~0.8B-parameter
#    random Llama, then the demo checkpoint.
# 3. `pdserve bench serve` on the GPU: 1P+1D (NIXL, GPU to GPU) vs 2 colocated engines.
# 4. scripts/bench_pe_copy.py: DualPath's host -> GPU copies of stored KV vs one pinned copy.
# 5. scripts/profile_offline.py: the GPU's busy time during bench offline's generate (launch-bound?).
#
# On the H200 (2026-12-04) the steps took: tests 137 s, make_0.8b 15 s, offline_0.8b 89 s, offline_demo
# 55 s, serve 65 s, pe_copy ~20 s, profile ~95 s: BUDGET_S=540 runs them all; a device call adds
# ~40 s to start and copy. The steps share BUDGET_S seconds (each is cut short at the budget; a step with no time left is
# skipped), so the whole run ends inside a lease. Where Python packages are missing (a machine with no
# registry), wheels in .whl/ are installed first (llguidance included: the engine imports it). On the
# H200 image (Python 3.12, CUDA 13; 2026-12-04) that was: fastapi starlette pydantic pydantic_core
# annotated-types typing-inspection typing_extensions uvicorn msgspec pyzmq llguidance openai httpx2
# httpcore2 jiter sniffio annotated-doc opentelemetry-api, and nixl-cu13 (not -cu12) with its
# nixl_ep_cu13/ folder deleted from the wheel (and from its RECORD) to fit the 64 MiB a call carries.
set -u
OUT=${OUT:-/tmp/gpu_check}
BUDGET_S=${BUDGET_S:-500}
LOGS=$OUT/logs  # every log and table; packed into $OUT/logs.tgz at the end (a device call returns 8 files)
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu NO_WHL=1 SKIP_BIG=1: a dry run of the script on a CPU machine
if [ -d .whl ] && [ -z "${NO_WHL:-}" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi

# run NAME MAX_S CMD...: CMD under a timeout of min(MAX_S, what is left of the budget), output to $LOGS/NAME.log
run() {
    local name=$1 max_s=$2 left=$((BUDGET_S - SECONDS - 5))
    shift 2
    [ "$left" -lt "$max_s" ] && max_s=$left
    if [ "$max_s" -le 10 ]; then echo "=== $(date +%T) $name: skipped (budget spent)"; return; fi
    echo "=== $(date +%T) $name (up to ${max_s} s)"
    timeout "$max_s" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v "Loading weights"
    echo "=== $(date +%T) $name: exit ${PIPESTATUS[0]}"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  $PY -c "from pdserve.transfer.nixl_backend import nixl_available; print('nixl', nixl_available())"
} 2>&1 | tee "$OUT/env.txt"

run tests 300 $PY -m pytest -q -p no:cacheprovider -rs --durations=12 -k cuda \
    tests/test_cuda.py tests/test_hf_equivalence.py tests/test_transfer_backends.py \
    tests/test_pd_e2e.py tests/test_dualpath_e2e.py tests/test_store_upload.py

if [ -z "${SKIP_BIG:-}" ]; then
    run make_0.8b 60 $PY -c "from pdserve.model.demo import make_demo_model; make_demo_model('/tmp/llama-0.8b', \
hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8)"
    run offline_0.8b 150 $PY -m pdserve.cli bench offline --model /tmp/llama-0.8b --device "$DEVICE" \
        --dtype bfloat16 --kv-cache-gib 16 --json "$OUT/offline_0.8b.json"
fi
run offline_demo 90 $PY -m pdserve.cli bench offline --device "$DEVICE" --dtype bfloat16 --kv-cache-gib 4 \
    --json "$OUT/offline_demo.json"
run serve 150 $PY -m pdserve.cli bench serve --device "$DEVICE" --dtype bfloat16 --json "$OUT/serve.json"
run pe_copy 60 $PY scripts/bench_pe_copy.py --device "$DEVICE" --json "$OUT/pe_copy.json"
run profile 120 $PY scripts/profile_offline.py --device "$DEVICE" --out "$LOGS/profile"
echo "=== $(date +%T) done in ${SECONDS} s"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"

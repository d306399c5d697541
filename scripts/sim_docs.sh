#!/usr/bin/env bash
# Regenerates every figure docs/simulation.md quotes: docs/sim/<scenario>.{json,png} and the extra runs
# in docs/sim/extra/ (each one scenario's command plus the flags its name says). Compiled simulator
# (`--accel on` builds it first when the sources changed); 14 min on two loaded cores. Not re-run:
# docs/sim/extra/ablation-before-session.json (a historical model, kept for comparison).
# Usage: bash scripts/sim_docs.sh [scenario ...]   (no argument: all of them; split includes split-ds27b)
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=(.venv/bin/python -m pdserve.sim.cli --accel on)
ONLY=("$@")
KNOWN="offline-660b ablation nic-balance pd-ratio online scale bandwidth-model submit-cost split"
for name in "$@"; do  # (a typo ran nothing and exited 0)
  [[ " $KNOWN " == *" $name "* ]] || { echo "sim_docs.sh: unknown scenario $name (known: $KNOWN)" >&2; exit 2; }
done
main() {  # scenario [name] [flags...]
  local sc=$1 name=${2:-$1}; shift 2 || shift 1
  "${SIM[@]}" --scenario "$sc" "$@" --json "docs/sim/$name.json" --plot "docs/sim/$name.png"
}
extra() {  # scenario name flags...
  local sc=$1 name=$2; shift 2
  "${SIM[@]}" --scenario "$sc" "$@" --json "docs/sim/extra/$name.json"
}
for sc in offline-660b ablation nic-balance pd-ratio online scale bandwidth-model submit-cost split; do
  if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" $sc "* ]]; then main "$sc" "$sc"; fi
done
if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" split "* ]]; then
  main split split-ds27b --model ds-27b --agents 1536
  extra split split-1p1d-buffer-inf --prefill-nodes 1 --decode-nodes 1 --host-buffer-gb inf
  extra split split-1p4d-cnic4000 --prefill-nodes 1 --decode-nodes 4 --cnic-gbps 4000
  extra split split-ds27b-2p1d-buffer-inf --model ds-27b --agents 1536 --prefill-nodes 2 --decode-nodes 1 --host-buffer-gb inf
fi
if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" ablation "* ]]; then
  extra ablation ablation-agents512 --agents 512
  extra ablation ablation-agents2048 --agents 2048
  extra ablation ablation-seed1 --seed 1
  extra ablation ablation-seed2 --seed 2
  extra ablation ablation-buffer-inf --host-buffer-gb inf
  extra ablation ablation-ep1 --prefill-ep-gpus 1
  extra ablation ablation-decode-ep1 --decode-ep-gpus 1
  for gbps in 500 600 800 4000; do
    extra ablation "ablation-snic$gbps" --policy basic,layerwise --snic-gbps "$gbps"
  done
fi
if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" pd-ratio "* ]]; then
  extra pd-ratio pd-ratio-seed1 --seed 1
  extra pd-ratio pd-ratio-seed2 --seed 2
  extra pd-ratio pd-ratio-buffer-inf --host-buffer-gb inf
  extra pd-ratio pd-ratio-cnic4000 --cnic-gbps 4000
  extra pd-ratio pd-ratio-ep1 --prefill-ep-gpus 1
  extra pd-ratio pd-ratio-decode-ep1 --decode-ep-gpus 1
  extra pd-ratio pd-ratio-oracle --policy oracle
  extra pd-ratio pd-ratio-oracle-ep1 --policy oracle --prefill-ep-gpus 1
fi
if [ ${#ONLY[@]} -eq 0 ] || [[ " ${ONLY[*]} " == *" online "* ]]; then
  extra online online-decode-ep1 --decode-ep-gpus 1
fi

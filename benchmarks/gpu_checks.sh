#!/usr/bin/env bash
# The GPU checks (../shared/spec/gpu-checks.md), as one script for a lent GPU machine that has torch but
# not all of relayrl's requirements: run from the source tree, with the missing wheels carried in .whl/
# (docs/performance.md, "On a GPU"). Each stage is time-boxed and writes its log (and results) to $OUT.
# The wheels, fetched here for the GPU machine's Python 3.12 (it has torch, transformers 5.17, accelerate,
# pyarrow; relayrl needs transformers >= 5.19, pydantic, math-verify; the TRL rows need trl and datasets):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==5.24.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#     math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19 trl==1.16.0
# (without the TRL rows the first eight are enough: 2026-11-28 carried transformers==5.19.0, pydantic==2.13.4,
# pydantic_core==2.46.4, annotated-types==0.7.0, typing-inspection==0.4.2 and the math-verify three, 15 MB)
#
#   bash benchmarks/gpu_checks.sh env tests tta engines trainer
#
# Stages: env (versions, GPU), tests (pytest -m gpu), tta (time to accuracy, relayrl vs TRL on the GPU),
# engines (generated tokens/s on the GPU), startup (an engine process's start, phase by phase), trainer (one step of a
# Qwen2.5-0.5B-shaped model, fp32 and bf16), speculative (the verification forward against k decoding forwards at the
# 0.5B shape in bf16; the demo's rollout tokens/s with drafts, on new prompts and, with TRAINED=<a checkpoint after
# RL>, on the same prompts again; each step's width chosen, and every draft verified, within SPEC_BATCH_TOKENS, 576),
# weight_sync (a Qwen2.5-0.5B-shaped full update to vLLM, file against the collective: needs vLLM's CUDA build
# carried to the machine; the collective is gloo through host memory, NCCL is not wired).
# TTA_SYSTEMS and TTA_NAME choose tta's systems and its results' name; speculation's time to accuracy on a GPU:
#   TTA_SYSTEMS="relayrl sync|sync + speculative, 576|relayrl async η=4|async η=4 + speculative, 576" \
#   TTA_NAME=tta_gpu_speculative bash benchmarks/gpu_checks.sh tta
# (at the default budget, 64 tokens a verification forward, a step of more than 32 live rows decodes plainly: the
# default demo's 64 rows draft only in their batch's tail)
set -u
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/transformers ]; then  # (once a machine)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheels did not install"
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
TTA_SEEDS=${TTA_SEEDS:-3}
TTA_SYSTEMS=${TTA_SYSTEMS:-trl|relayrl sync|relayrl async η=4}
stage() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "== $name (at most $secs s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" >"$OUT/$name.log" 2>&1
  echo "   rc=$? in $((SECONDS - t0)) s; last lines:"; tail -n 25 "$OUT/$name.log" | sed 's/^/   /'
}
for s in "$@"; do
  case $s in
    env) stage env 60 bash -c 'nvidia-smi -L; python3 -c "import torch, transformers, sys; print(sys.version);
print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0));
print(\"transformers\", transformers.__version__); import relayrl.run.loop, pyarrow; print(\"pyarrow\", pyarrow.__version__); import trl; print(\"trl\", trl.__version__)"' ;;
    tests) stage tests "${TESTS_S:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_distributed.py \
      tests/test_engine_hf.py tests/test_checkpoint_durability.py tests/test_speculative.py ;;
    tta) IFS='|' read -ra sys <<<"$TTA_SYSTEMS"
      stage tta "${TTA_S:-300}" python3 benchmarks/time_to_accuracy.py --seeds "$TTA_SEEDS" --device cuda \
        --first-seed "${TTA_FIRST:-0}" \
        --systems "${sys[@]}" --out "$OUT" --name "${TTA_NAME:-tta_gpu}" ;;
    engines) IFS='|' read -ra only <<<"${ENGINES_ONLY:-hf (|hf-cb blocks 512}"
      stage engines "${ENGINES_S:-150}" python3 benchmarks/engines.py --device cuda --repeats 2 \
        --requests ${ENGINES_REQUESTS:-64 256} --only "${only[@]}" --out "$OUT" --name engines_gpu ;;
    startup) stage startup 90 python3 benchmarks/engine_startup.py --device cuda ;;
    trainer) stage trainer "${TRAINER_S:-150}" python3 benchmarks/trainer_scale.py --device cuda --out "$OUT" \
      --name trainer_gpu ;;
    speculative) spec=(python3 benchmarks/speculative.py --device cuda --out "$OUT" --name speculative_gpu)
      stage spec_verify 120 "${spec[@]}" --parts verify --dtype bfloat16 --batches 1 16 64 256 --draft-lengths 2 4 8 \
        --repeats 5
      stage spec_fresh 180 "${spec[@]}_fresh" --parts rollout --trained "" --fresh --epochs 6 --prompts 1 8 32 \
        --settings off "siblings + history" recent "all + recent" "all + recent, every draft" \
        --batch-tokens "${SPEC_BATCH_TOKENS:-576}"
      stage spec_again 180 "${spec[@]}_again" --parts rollout --trained "${TRAINED:-}" --epochs 4 --prompts 1 8 32 \
        --settings off "siblings + history" all "all + recent" "all + recent, every draft" \
        --batch-tokens "${SPEC_BATCH_TOKENS:-576}" ;;
    weight_sync) stage weight_sync "${SYNC_S:-300}" python3 benchmarks/weight_sync.py --bucket-mb 512 2048 --out "$OUT" ;;
    *) echo "unknown stage $s" ;;
  esac
done
rm -f "$OUT"/*.md  # the tables are in the logs; what comes back is limited in files

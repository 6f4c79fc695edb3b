#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks in one device call; logs and JSON go to $OUT (default benchmarks/out).
# Usage: benchmarks/run_gpu.sh [tests] [a] [b] [c] [d] [w] [s] [p] [g] [t] [al] [sd] [lora] [lops] [rl] [x2]   (no argument: all but s, p, g, t, al, sd, lora, rl and x2)
# g: small-M linear kernel configs against cuBLAS.
# t: decode attention tile configs, split-KV and program order, at one context length and at mixed lengths.
# al: (a) without HF, decode attention programs longest context first.
# sd: speculative decoding speed-up at batch 1 and 16 (n-gram, draft model) with acceptance rates.
# lora (issue 26): 0.6B offline throughput with 4 rank-16 adapters mixed against the base model's, and ipc adapter
#   sync (rank 16, all projections, bf16) beside the full sync for 0.6B and 7B. About 3 minutes.
# rl (issue 30): the short-answer GRPO rollout (64 prompts x 16, 512-token prompts, 32 new tokens), 0.6B: time
#   against the schedule's floor and the GPU's busy share, at the engine's default budget (vLLM's: 16384 tokens a
#   step for an LLM on an H100/H200) and at 2048 (the old default, and a plain AsyncLLM's); and with 1024 rows a
#   step (vLLM's max_num_seqs for an LLM on those GPUs; ours is 256).
# lp (issue 26): where a rank-16 adapter sync's time goes, 0.6B shape: each hop's median ms over 60 traced ipc syncs
#   (weight_sync.py --trace: the trainer's and the engine's processes mark them), then 200 syncs under py-spy (every
#   process, idle frames too, per thread), raw stacks in $OUT/lora-sync-pyspy.txt.
# lops (issue 26): each device op of a rank-16 adapter sync of the 0.6B shape alone (lora_sync_ops.py): host ms
#   per call and kernels launched, multi-tensor against per-tensor and flat.
# p: where the offline run's time goes (per-step host/GPU split, top kernels).
# x2 (two GPUs): the two-GPU tests, nccl/sharded_rdt/sparse weight sync GPU 0 -> GPU 1, TP=2 and DP=2 throughput.
set -uo pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
parts=${*:-tests a b c d w}
py=${PYTHON:-python3}
run() { local name=$1; shift; echo "=== $name: $*"; local t=$SECONDS; "$@" 2>&1 | tee "$OUT/$name.log"; echo "=== $name took $((SECONDS - t)) s"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
for part in $parts; do
  case $part in
    # Every gpu-marked test lives in tests/gpu (tests/conftest.py refuses to collect one elsewhere).
    tests) run gpu_tests $py -m pytest tests/gpu -q -m gpu -p no:cacheprovider -rA ;;  # two-GPU tests skip on one GPU
    x2) run two_gpu_tests $py -m pytest tests/gpu/test_two_gpus_dp.py tests/gpu/test_tp_nccl_gpu.py \
          tests/gpu/test_ep_nccl_gpu.py tests/gpu/test_nccl_two_gpus.py -q -m gpu -p no:cacheprovider -rA
        run multi_gpu_sync $py benchmarks/multi_gpu_sync.py --backends nccl nccl-unpacked sparse_nccl sharded_rdt \
          --sparse-snapshot-device cuda --models qwen3-0.6b qwen2.5-1.5b qwen2.5-7b --json-out "$OUT/h200x2-multi-gpu-sync.json"
        run offline_7b_tp2 $py benchmarks/offline_throughput.py --shape qwen2.5-7b --tensor-parallel-size 2 --num-requests 256 \
          --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --temperature 0.6 \
          --skip-hf --json-out "$OUT/h200x2-7b-offline-tp2.json"
        run offline_0.6b_dp2 $py benchmarks/offline_throughput.py --shape qwen3-0.6b --data-parallel-size 2 --num-requests 512 \
          --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 --temperature 0.6 \
          --skip-hf --json-out "$OUT/h200x2-0.6b-offline-dp2.json" ;;
    a) run offline_0.6b $py benchmarks/offline_throughput.py --shape qwen3-0.6b --num-requests 256 \
         --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
         --temperature 0.6 --hf-num-requests 16 --hf-batch-size 16 --json-out "$OUT/h200-offline-throughput.json" ;;
    al) run offline_0.6b_longest $py benchmarks/offline_throughput.py --shape qwen3-0.6b --num-requests 256 \
         --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
         --temperature 0.6 --skip-hf --attention-order longest --json-out "$OUT/h200-offline-throughput-longest-first.json" ;;
    b) run decode_0.6b $py benchmarks/decode_latency.py --shape qwen3-0.6b --json-out "$OUT/h200-decode-latency.json" ;;
    c) run grpo_0.6b $py benchmarks/grpo_rollout.py --shape qwen3-0.6b --json-out "$OUT/h200-grpo-rollout.json" ;;
    d) run offline_7b $py benchmarks/offline_throughput.py --shape qwen2.5-7b --num-requests 256 \
         --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
         --temperature 0.6 --hf-num-requests 8 --hf-batch-size 8 --json-out "$OUT/h200-7b-offline-throughput.json"
       run decode_7b $py benchmarks/decode_latency.py --shape qwen2.5-7b --json-out "$OUT/h200-7b-decode-latency.json" ;;
    g) run gemv_configs $py benchmarks/gemv_configs.py --json-out "$OUT/h200-gemv-configs.json" ;;
    t) run attention_configs $py benchmarks/attention_configs.py --json-out "$OUT/h200-attention-configs.json" ;;
    sd) run spec_decode_0.6b $py benchmarks/spec_decode.py --shape qwen3-0.6b --json-out "$OUT/h200-spec-decode.json" ;;
    lp) run lora_sync_hops $py benchmarks/weight_sync.py --device cuda --backends ipc --buffer-mib 1024 --syncs 3 \
          --models qwen3-0.6b qwen2.5-7b --lora-rank 16 --lora-syncs 60 --trace "$OUT/lora-sync-trace.log" \
          --json-out "$OUT/h200-weight-sync-lora-hops.json"
        run lora_sync_profile ${PYSPY:-py-spy} record -r 2000 --subprocesses --idle -t -f raw -o "$OUT/lora-sync-pyspy.txt" \
          -- $py benchmarks/weight_sync.py --device cuda --backends ipc --buffer-mib 1024 --syncs 1 --models qwen3-0.6b \
          --lora-rank 16 --lora-syncs 200 --json-out "$OUT/lora-sync-profiled.json" ;;
    lops) run lora_sync_ops $py benchmarks/lora_sync_ops.py --device cuda --shape qwen3-0.6b --rank 16 \
            --json-out "$OUT/h200-lora-sync-ops.json" ;;
    p) run step_profile_0.6b $py benchmarks/step_profile.py --shape qwen3-0.6b --json-out "$OUT/h200-step-profile.json" ;;
    s) run sampling_micro $py benchmarks/sampling_micro.py --device cuda --out "$OUT/h200-sampling-micro.json" ;;
    w) run weight_sync $py benchmarks/weight_sync.py --device cuda --backends ipc --buffer-mib 1024 --syncs 5 \
         --models qwen3-0.6b qwen2.5-1.5b qwen2.5-7b --json-out "$OUT/h200-weight-sync.json" ;;
    lora) run offline_0.6b_lora $py benchmarks/offline_throughput.py --shape qwen3-0.6b --num-requests 256 \
            --input-len 100 1024 --output-len 100 1024 --max-num-seqs 256 --max-num-batched-tokens 8192 \
            --temperature 0.6 --skip-hf --num-loras 4 --lora-rank 16 --json-out "$OUT/h200-offline-throughput-lora.json"
          run weight_sync_lora $py benchmarks/weight_sync.py --device cuda --backends ipc --buffer-mib 1024 --syncs 3 \
            --models qwen3-0.6b qwen2.5-7b --lora-rank 16 --lora-syncs 20 --json-out "$OUT/h200-weight-sync-lora.json" ;;
    rl) run grpo_short_answers $py benchmarks/grpo_rollout.py --shape qwen3-0.6b --num-prompts 64 --n 16 --prompt-len 512 \
            --max-tokens 32 --repeats 3 --floor --busy --json-out "$OUT/h200-grpo-short-answers.json"
        run grpo_short_answers_2048 $py benchmarks/grpo_rollout.py --shape qwen3-0.6b --num-prompts 64 --n 16 \
            --prompt-len 512 --max-tokens 32 --repeats 3 --floor --busy --max-num-batched-tokens 2048 \
            --json-out "$OUT/h200-grpo-short-answers-2048.json"
        run grpo_short_answers_1024_seqs $py benchmarks/grpo_rollout.py --shape qwen3-0.6b --num-prompts 64 --n 16 \
            --prompt-len 512 --max-tokens 32 --repeats 3 --floor --busy --max-num-seqs 1024 \
            --json-out "$OUT/h200-grpo-short-answers-1024-seqs.json" ;;
    *) echo "unknown part $part" ;;
  esac
done

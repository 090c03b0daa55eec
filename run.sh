#!/usr/bin/env bash
# Named launch recipes: `bash run.sh NAME [extra flags]`. Each is one command; flags after NAME are appended.
set -euo pipefail
cd "$(dirname "$0")"
recipe=${1:?usage: bash run.sh {tiny|tiny-2ranks|qwen-ocr-1gpu|qwen-ocr-8gpu|qwen-ocr-2nodes|qwen-ocr-vllm} [flags]}
shift
case $recipe in
  tiny)            python flowgrpo.py --model tiny "$@" ;;                                  # CPU demo, ~1 minute
  tiny-2ranks)     torchrun --standalone --nproc_per_node=2 flowgrpo.py --model tiny "$@" ;;  # FSDP2 over gloo
  qwen-ocr-1gpu)   python flowgrpo.py --model qwen-image "$@" ;;                            # one GPU (--offload if short of memory)
  qwen-ocr-8gpu)   torchrun --standalone --nproc_per_node=8 flowgrpo.py --model qwen-image "$@" ;;
  qwen-ocr-2nodes) torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                     --rdzv-endpoint="${MASTER:?set MASTER=host:port of node 0}" flowgrpo.py --model qwen-image "$@" ;;
  qwen-ocr-vllm)   torchrun --standalone --nproc_per_node=4 flowgrpo.py --model qwen-image --rollout vllm-omni \
                     --rollout-url "${SERVERS:?set SERVERS=http://host:port,...}" "$@" ;;  # servers: see README
  *) echo "unknown recipe $recipe" >&2; exit 2 ;;
esac

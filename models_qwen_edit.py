"""Qwen-Image-Edit (`qwen-image-edit`: Qwen/Qwen-Image-Edit-2511; `tiny-qwen-image-edit`), the second edit family,
around diffusers' QwenImageEditPlusPipeline: Qwen-Image's adapter (models_qwen.py) with a source image per prompt.

The source image arrives in the prompt's metadata (`"image"`: a path, prompts.py) and reaches the transformer twice,
as `QwenImageEditPlusPipeline.__call__` sends it:
- through the text encoder: resized to about CONDITION_IMAGE_SIZE pixels (its aspect ratio kept, sides multiples of
  32: the pipeline's `calculate_dimensions`) and put in the prompt's template as "Picture 1: <|vision_start|>
  <|image_pad|><|vision_end|>" before the prompt; Qwen2.5-VL's vision tower encodes it into the image-pad tokens and
  the last hidden states of the whole sequence (less the template's system prefix) are the prompt embeddings. The
  negative prompt is encoded with the same image: both CFG branches see the source.
- through the VAE: resized to about VAE_IMAGE_SIZE pixels (the same rule), encoded (the distribution's mode),
  normalised and packed; its tokens follow the noisy tokens in the transformer's sequence, `img_shapes` lists both
  grids, and the velocity is the output's first S tokens.
Both sizes are read from the pipeline's module at call time (a test shrinks them). Each (prompt, image) pair is encoded
alone and each image VAE-encoded once, alone (batch 1, as the pipeline, which takes one prompt a call): the bits do not
depend on what else a batch holds.
"""
import base64
import importlib
import importlib.util
import io
import json
import os

import torch
from PIL import Image

import source_images
from models_base import EditAdapter, from_pretrained
from models_qwen import QwenImage, build_tiny_qwen_pipeline


def image_only_processor(image_processor, tokenizer):
    """A Qwen2VLProcessor without its video half. transformers builds Qwen2VLProcessor's video processor only with
    torchvision installed; images need none, so without torchvision the tiny pipeline (and a real one's loading) take
    this subclass, whose only difference is that `video_processor` is not one of its parts. Saved, it writes the video
    half's config too (its class, at its defaults), as the real model's processor/ holds one: a Qwen2VLProcessor
    reads it where torchvision is installed (a vLLM-Omni server loads the directory so)."""
    from transformers import Qwen2VLProcessor

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

        def save_pretrained(self, save_directory, **kwargs):
            saved = super().save_pretrained(save_directory, **kwargs)
            with open(os.path.join(save_directory, "video_preprocessor_config.json"), "w") as f:
                json.dump({"video_processor_type": "Qwen2VLVideoProcessor"}, f)
            return saved
    return ImageOnlyQwen2VLProcessor(image_processor, tokenizer)


def build_tiny_qwen_edit_pipeline(seed: int = 0):
    """A random-weight QwenImageEditPlusPipeline: `tiny`'s parts and weights (Qwen-Image-Edit has Qwen-Image's
    architecture; editing is in its weights, and its text encoder's vision tower, which `tiny` builds but never uses)
    with a Qwen2-VL processor built in code: transformers' PIL image processor at its defaults (14-pixel patches,
    2×2 merged, as the tiny vision tower's config) and the real Qwen2 tokenizer. On disk (`save-tiny`) the processor
    is named a Qwen2VLProcessor, as in the real model's directory (`QwenImageEdit.load` reads it back)."""
    from diffusers import QwenImageEditPlusPipeline
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    parts = build_tiny_qwen_pipeline(seed).components
    processor = image_only_processor(Qwen2VLImageProcessorPil(), parts["tokenizer"])
    pipe = QwenImageEditPlusPipeline(processor=processor, **parts)
    pipe.register_to_config(processor=("transformers", "Qwen2VLProcessor"))
    return pipe


class QwenImageEdit(EditAdapter, QwenImage):
    """Qwen-Image-Edit around QwenImageEditPlusPipeline. x is Qwen-Image's packed latents (B, S, C·4); the conditioning
    adds `source` (B, S', C·4), the packed source latents in the model dtype, and `source_grid` (B, 2), their (rows,
    columns) of patches; `embeds`/`mask` (and `neg_embeds`/`neg_mask`) are the prompt encoded with the source."""
    pipeline_class = "QwenImageEditPlusPipeline"
    default_path = "Qwen/Qwen-Image-Edit-2511"
    omni_pipeline_class = "omni.pipeline_edit.FlowGRPOQwenImageEditPlusPipeline"
    max_sequence_length = 1024  # its pipeline cuts no prompt; vLLM-Omni's refuses one longer than this (QwenImage: 512)
    build_tiny = staticmethod(build_tiny_qwen_edit_pipeline)

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, **options) -> "QwenImageEdit":
        """As every adapter loads (models_base.Adapter.load), but without torchvision the pipeline directory's
        processor is read here (its tokenizer and image processor; see `image_only_processor`) and handed to
        `from_pretrained`, which could not build it."""
        if path is None and model.startswith("tiny"):
            return super().load(model, path, device, seed, **options)
        tiny = model.startswith("tiny")
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" and not tiny else torch.float32
        path = path or cls.default_path
        kwargs = {} if tiny else {"dtype": dtype}
        if importlib.util.find_spec("torchvision") is None:
            from transformers import Qwen2Tokenizer
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
            try:
                kwargs["processor"] = image_only_processor(
                    Qwen2VLImageProcessorPil.from_pretrained(path, subfolder="processor"),
                    Qwen2Tokenizer.from_pretrained(path, subfolder="processor"))
            except (OSError, ValueError):
                pass  # from_pretrained below names what cannot be read, in one line
        return cls(from_pretrained(cls.pipeline_class, model, path, **kwargs), device, dtype, **options)

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float,
                     metadata: list[dict] | None = None, height: int = 0, width: int = 0) -> dict:
        """`embeds` (B, L, D) and `mask` (B, L): each prompt encoded with its source image (`metadata[i]["image"]`, a
        path), each distinct pair alone, padded to the longest as the pipeline pads; with CFG (cfg_scale > 1) the
        negative prompt encoded with each source as `neg_embeds`, `neg_mask`; `source` (B, S', C·4) and
        `source_grid` (B, 2) from `encode_source`, once per distinct image."""
        paths = [m.get("image") for m in metadata or [{}] * len(prompts)]
        if None in paths:
            raise ValueError(f"{self.pipeline_class} edits a source image: every prompt needs one in its metadata "
                             '("image": a path; prompts.py reads it from a .jsonl)')
        images = {path: self.encode_source(path) for path in dict.fromkeys(paths)}
        if len({tuple(grid.tolist()) for _, grid, _ in images.values()}) > 1:
            raise ValueError("the source images of one batch give latent grids of different sizes: crop them to one "
                             "aspect ratio (at start-up prompts.py checks each against --height/--width)")
        conditions = {path: condition for path, (_, _, condition) in images.items()}
        cond = self._embed(list(zip(prompts, paths)), conditions)
        if cfg_scale > 1:
            neg = self._embed([(negative_prompt, path) for path in paths], conditions)
            cond |= {"neg_embeds": neg["embeds"], "neg_mask": neg["mask"]}
        cond["source"] = torch.cat([images[path][0] for path in paths])
        cond["source_grid"] = torch.stack([images[path][1] for path in paths])
        return cond

    @torch.no_grad()
    def _embed(self, pairs: list[tuple[str, str]], conditions: dict[str, Image.Image]) -> dict:
        """`embeds` (B, L, D) in the model dtype and `mask` (B, L) of (prompt, source path) pairs: each distinct pair
        through the pipeline's own `encode_prompt` alone, with the source's copy for the text encoder (`conditions`)
        (template, vision tokens, dropped prefix), then padded with zeros to the longest and masked out, as the
        pipeline's `_get_qwen_prompt_embeds` pads a batch."""
        distinct = list(dict.fromkeys(pairs))
        encoded = [self.pipe.encode_prompt(prompt=[p], image=[conditions[path]], device=self.device)[0][0]
                   for p, path in distinct]
        longest = max(e.shape[0] for e in encoded)
        embeds = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[0])) for e in encoded])
        mask = torch.stack([torch.arange(longest, device=self.device) < e.shape[0] for e in encoded]).long()
        index = torch.tensor([distinct.index(pair) for pair in pairs], device=self.device)
        return {"embeds": embeds[index].to(self.dtype), "mask": mask[index]}

    @torch.no_grad()
    def source_areas(self) -> list[int]:
        """The pixel areas a source is resized to for the text encoder and for the VAE: the pipeline's module's
        CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE, read now (a test shrinks them)."""
        module = importlib.import_module(type(self.pipe).__module__)
        return [module.CONDITION_IMAGE_SIZE, module.VAE_IMAGE_SIZE]

    def omni_knobs(self, metadata: dict, height: int, width: int) -> dict:
        """`source`: the prompt's source image as it is (RGB, a base64 PNG: the same pixels), and `source_areas`: the
        server resizes it as `encode_source` does (omni/pipeline_edit.py)."""
        png = io.BytesIO()
        source_images.read(metadata["image"]).save(png, format="PNG")
        return {"source": base64.b64encode(png.getvalue()).decode("ascii"), "source_areas": self.source_areas()}

    def encode_source(self, path: str) -> tuple[torch.Tensor, torch.Tensor, Image.Image]:
        """One source image (an RGB image file) → (its packed latents (1, S', C·4) in the model dtype, their grid
        (rows, columns) of patches as a LongTensor (2,), its copy for the text encoder (a PIL image)): resized and
        encoded exactly as `QwenImageEditPlusPipeline.__call__` prepares its `image`."""
        pipe = self.pipe
        image = source_images.read(path)
        # the pipeline's `calculate_dimensions` at its module's sizes
        module = importlib.import_module(type(pipe).__module__)
        ratio = image.size[0] / image.size[1]
        (cw, ch), (vw, vh) = (module.calculate_dimensions(area, ratio) for area in self.source_areas())
        condition = pipe.image_processor.resize(image, ch, cw)
        pixels = pipe.image_processor.preprocess(image, vh, vw).unsqueeze(2).to(self.device, self.dtype)
        z = pipe._encode_vae_image(pixels, generator=None)  # (1, C, 1, h, w), normalised by the VAE's mean and std
        packed = pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4]).to(self.dtype)
        grid = torch.tensor([vh // self.multiple, vw // self.multiple], device=self.device)
        return packed, grid, condition

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4): Qwen-Image's transformer call on [x, source] (B, S + S', C·4) per CFG branch, its
        output's first S tokens, combined as Qwen-Image's true CFG with its per-token norm rescale (models_qwen.py)."""
        # as the pipeline: σ·1000 in the latents' dtype (σ may come from the CPU: the schedule lives there)
        timestep = (sigma.to(self.device, torch.float32) * 1000).to(self.dtype) / 1000
        rows, columns = cond["source_grid"][0].tolist()
        img_shapes = [[(1, height // self.multiple, width // self.multiple), (1, rows, columns)]] * x.shape[0]
        hidden, n = torch.cat([x.to(self.dtype), cond["source"]], dim=1), x.shape[1]
        v = self._forward(hidden, timestep, cond["embeds"], cond["mask"], img_shapes)[:, :n]
        if cfg_scale > 1:
            v_neg = self._forward(hidden, timestep, cond["neg_embeds"], cond["neg_mask"], img_shapes)[:, :n]
            v_cfg = v_neg + cfg_scale * (v - v_neg)
            v = v_cfg * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(v_cfg, dim=-1, keepdim=True))
        return v


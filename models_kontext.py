"""FLUX.1 Kontext (`flux.1-kontext-dev`, `tiny-flux-kontext`), the first edit family, around diffusers'
FluxKontextPipeline: FLUX.1-dev's adapter (models_flux.py) with a source image per prompt.

The source image arrives in the prompt's metadata (`"image"`: a path, prompts.py) and is encoded once per rollout in
`conditioning`, as the pipeline prepares it: resized to the output size, `image_processor.preprocess`,
`_encode_vae_image` (argmax: the latent distribution's mode, no noise), `_pack_latents`. Every transformer call then
sees the noisy tokens followed by the source's, whose position ids are the same grid with first coordinate 1, and
returns the velocity of the noisy tokens alone, as `FluxKontextPipeline.__call__` does per step (one pass with the
guidance embedding, no CFG).
"""
import base64
import io

import torch
from PIL import Image

import source_images
from models_base import EditAdapter
from models_flux import Flux, build_tiny_flux_pipeline


def build_tiny_kontext_pipeline(seed: int = 0):
    """A random-weight FluxKontextPipeline: tiny-flux's parts and weights (FLUX.1 Kontext-dev has FLUX.1-dev's
    architecture; editing is in its weights), held by the edit pipeline."""
    return build_tiny_flux_pipeline(seed, pipeline="FluxKontextPipeline")


class FluxKontext(EditAdapter, Flux):
    """FLUX.1 Kontext around FluxKontextPipeline. x is FLUX's packed latents (B, S, C·4); `cond["source"]` the
    packed source latents (B, S, C·4) in the model dtype, beside FLUX's `embeds` and `pooled`.

    The output size is the run's --height/--width and the source is resized to it, as Flow-GRPO's Kontext script
    does (PIL's bicubic to the output size, scripts/train_flux_kontext.py:229 at 9745241; its pipeline's resize to that
    size is then none). diffusers' FluxKontextPipeline, with `_auto_resize=False` and `max_area=height·width`, keeps a
    source at its own size: the two agree for a source at the output size (tests/test_edit.py)."""
    pipeline_class = "FluxKontextPipeline"
    default_path = "black-forest-labs/FLUX.1-Kontext-dev"
    omni_pipeline_class = "omni.pipeline_edit.FlowGRPOFluxKontextPipeline"
    build_tiny = staticmethod(build_tiny_kontext_pipeline)

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float,
                     metadata: list[dict] | None = None, height: int = 0, width: int = 0) -> dict:
        """FLUX's prompt conditioning plus `source` (B, S, C·4): each prompt's source image (`metadata[i]["image"]`,
        a path) at the output size (height, width), each distinct image encoded once, alone (batch 1, as the
        pipeline encodes each image with its own generator: the bits do not depend on what else a batch holds)."""
        cond = super().conditioning(prompts, negative_prompt, cfg_scale)
        paths = [m.get("image") for m in metadata or [{}] * len(prompts)]
        if None in paths or not height or not width:
            raise ValueError(f"{self.pipeline_class} edits a source image: every prompt needs one in its metadata "
                             '("image": a path; prompts.py reads it from a .jsonl), and the output height and width')
        distinct = list(dict.fromkeys(paths))
        encoded = torch.cat([self.encode_source(path, height, width) for path in distinct])
        cond["source"] = encoded[torch.tensor([distinct.index(p) for p in paths], device=self.device)]
        return cond

    def resized_source(self, path: str, height: int, width: int) -> Image.Image:
        """One source image (an RGB image file) at the output size, resized as Flow-GRPO's script resizes it."""
        return source_images.read(path).resize((width, height), Image.BICUBIC)

    def omni_knobs(self, metadata: dict, height: int, width: int) -> dict:
        """`source`: the prompt's source image at the output size, a base64 PNG (the same pixels). vLLM-Omni's Kontext
        pipeline resizes a source to its own size: sent resized, it is encoded as `encode_source` encodes it."""
        png = io.BytesIO()
        self.resized_source(metadata["image"], height, width).save(png, format="PNG")
        return {"source": base64.b64encode(png.getvalue()).decode("ascii")}

    @torch.no_grad()
    def encode_source(self, path: str, height: int, width: int) -> torch.Tensor:
        """One source image (an RGB image file) → its packed latents (1, S, C·4) in the model dtype: resized to
        (height, width), then the pipeline's own preprocessing, VAE encoding (argmax) and packing."""
        pipe = self.pipe
        image = self.resized_source(path, height, width)
        pixels = pipe.image_processor.preprocess(image, height, width).to(self.device, self.dtype)
        z = pipe._encode_vae_image(pixels, generator=None)  # (1, C, h, w), normalised by the VAE's shift and scale
        return pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).to(self.dtype)

    def image_ids(self, batch: int, height: int, width: int) -> torch.Tensor:
        """(2S, 3): the noisy tokens' ids (0, row, column), then the source's, (1, row, column)."""
        ids = super().image_ids(batch, height, width)
        source = ids.clone()
        source[:, 0] = 1
        return torch.cat([ids, source])

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4): FLUX's transformer call on [x, source] (B, 2S, C·4), its output's first S tokens."""
        hidden = torch.cat([x.to(self.dtype), cond["source"]], dim=1)
        return super().velocity(hidden, sigma, cond, cfg_scale, height, width)[:, :x.shape[1]]

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `FluxKontextPipeline.__call__` arguments that sample from exactly these prompt conditions; the caller
        adds the source images (`image`) and `max_area=height·width`."""
        return super().pipeline_kwargs(cond, cfg_scale) | {"_auto_resize": False}

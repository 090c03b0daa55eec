"""vLLM-Omni 0.30.0 custom pipelines of the edit families, FLUX.1 Kontext and Qwen-Image-Edit, sampled with this
project's sampler (omni.pipeline.FlowGRPOSampler: the same `scheduler.step`, the same trajectory file).

    PYTHONPATH=<this repo> vllm serve <pipeline dir> --omni --host 127.0.0.1 --dtype float32 --custom-pipeline-args \
        '{"pipeline_class": "omni.pipeline_edit.<CLASS>", "trajectory_root": "/dev/shm/flowgrpo"}'

<CLASS>: the adapter's `omni_pipeline_class` (FlowGRPOFluxKontextPipeline, FlowGRPOQwenImageEditPlusPipeline).
Only the server process imports this module.

vLLM-Omni 0.30.0's `/v1/images/generations` takes no image and its `/v1/images/edits` no `extra_params` (where this
project's knobs travel, omni/pipeline.py): an edit request is a generation request whose knobs carry the source,
    source        the prompt's source image, a base64 PNG of at most SOURCE_PIXELS pixels (read within SOURCE_CHARS
                  characters, its size checked before its pixels are decoded); Kontext's at the output size
    source_areas  Qwen-Image-Edit's: the pixel areas the source is resized to for the text encoder and for the VAE (the
                  trainer's pipeline's CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE: both sides resize alike)
The trainer's adapters build them (models_kontext.FluxKontext.omni_knobs, models_qwen_edit.QwenImageEdit.omni_knobs).
Neither parent pipeline batches requests (one prompt, one source a pass): serve them with --max-num-seqs 1 (the
default; vLLM-Omni refuses more for Kontext).
"""
import base64
import io
from types import SimpleNamespace

from PIL import Image
from vllm_omni.diffusion.models.flux.pipeline_flux_kontext import FluxKontextPipeline
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit import calculate_dimensions
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus import QwenImageEditPlusPipeline
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

import source_images
from omni.pipeline import KEY, FlowGRPOSampler, expose_flux_lora_names, flux_velocity, qwen_velocity

SOURCE_PIXELS = 4096 * 4096  # the largest source image a request may carry
SOURCE_CHARS = 64 << 20  # the longest `source` knob read (base64 text)
SOURCE_CHUNKS = 4096  # a PNG's chunks (the trainer's: Pillow's 64 KiB IDAT chunks, 768 at SOURCE_CHARS)


def decode_source(text) -> Image.Image:
    """knobs["source"]: the RGB source image the trainer sent, checked before its pixels are decoded (bounded text,
    base64, a PNG of at most SOURCE_CHUNKS chunks, counted from their headers (a million empty ones took 7.7 s to
    parse), and of at most SOURCE_PIXELS pixels of 8-bit channels), as the reward server checks its images."""
    if not isinstance(text, str) or len(text) > SOURCE_CHARS:
        raise ValueError(f"extra_params.{KEY}.source must be a base64 PNG of at most {SOURCE_CHARS} characters")
    try:
        data = base64.b64decode(text, validate=True)
        source_images.check_png(io.BytesIO(data), SOURCE_CHUNKS)
        image = Image.open(io.BytesIO(data), formats=["PNG"])
    except (ValueError, OSError, Image.DecompressionBombError) as e:  # binascii.Error is a ValueError
        raise ValueError(f"extra_params.{KEY}.source is not a base64 PNG within bounds ({e})") from None
    if image.width * image.height > SOURCE_PIXELS:
        raise ValueError(f"extra_params.{KEY}.source is {image.width}×{image.height}: more than {SOURCE_PIXELS} pixels")
    if image.mode not in source_images.MODES:
        raise ValueError(f"extra_params.{KEY}.source has pixel mode {image.mode}: send 8-bit channels")
    return image.convert("RGB")


class FlowGRPOFluxKontextPipeline(FlowGRPOSampler, FluxKontextPipeline):
    """vLLM-Omni's FluxKontextPipeline (FLUX.1 Kontext) with this project's sampler (models_kontext.FluxKontext's
    twin): the source image comes in the knobs; the velocity is FLUX's on [x, source] (B·n, 2S, 4C), its first S."""
    extra_knobs = ("source",)

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        expose_flux_lora_names(self.transformer)

    def forward(self, req: DiffusionRequestBatch, **kwargs):
        sp = req.sampling_params  # one request a pass: vLLM-Omni 0.30.0 refuses --max-num-seqs > 1 for Kontext
        source = ((sp.extra_args or {}).get(KEY) or {}).get("source")
        if source is not None:  # the parent resizes a source to its own size: it must come at the output size
            kwargs["image"] = decode_source(source)
            if kwargs["image"].size != (sp.width, sp.height):
                raise ValueError(f"extra_params.{KEY}.source is {kwargs['image'].width}×{kwargs['image'].height}, "
                                 f"not the request's {sp.width}×{sp.height}")
        return super().forward(req, **kwargs)

    def prepare_latents(self, image, batch_size, num_channels_latents, height, width, dtype, device, generator=None,
                        latents=None):
        """The noise as FlowGRPOSampler draws it (float32, one generator per image), the source's latents in the
        server's dtype (as the trainer's adapter encodes them: the VAE runs in its own dtype)."""
        if self._run is None:
            return super().prepare_latents(image, batch_size, num_channels_latents, height, width, dtype, device,
                                           generator, latents)
        noise, _, latent_ids, _ = super().prepare_latents(None, batch_size, num_channels_latents, height, width, dtype,
                                                          device, generator, latents)
        _, source, _, source_ids = FluxKontextPipeline.prepare_latents(
            self, image, batch_size, num_channels_latents, height, width, dtype, device, None, noise)
        return noise, source, latent_ids, source_ids

    def velocity(self, a: SimpleNamespace):
        if a.image_latents is None:  # the trainer always sends one (models_kontext.FluxKontext.omni_knobs)
            raise ValueError(f"FlowGRPOFluxKontextPipeline edits a source image: extra_params.{KEY}.source is missing")
        return flux_velocity(self, a, a.latent_ids, a.image_latents)


class FlowGRPOQwenImageEditPlusPipeline(FlowGRPOSampler, QwenImageEditPlusPipeline):
    """vLLM-Omni's QwenImageEditPlusPipeline (Qwen-Image-Edit-2511) with this project's sampler
    (models_qwen_edit.QwenImageEdit's twin): the source comes in the knobs and is prepared here as vLLM-Omni's
    pre-processing prepares an uploaded image, at the trainer's areas; the velocity is Qwen-Image's on [x, source]."""
    extra_knobs = ("source", "source_areas")

    def forward(self, req: DiffusionRequestBatch, **kwargs):
        request = req.requests[0]  # one request a pass: the parent takes the first prompt of a batch only
        knobs = (request.sampling_params.extra_args or {}).get(KEY) or {}
        if "source" in knobs:
            prompt = {"prompt": request.prompt} if isinstance(request.prompt, str) else request.prompt
            prompt["additional_information"] = self.source_inputs(decode_source(knobs["source"]),
                                                                  knobs.get("source_areas"))
            request.prompt = prompt
        return super().forward(req, **kwargs)

    def source_inputs(self, image: Image.Image, areas) -> dict:
        """What the parent's `forward` reads of a source (vLLM-Omni's pre_process_func's fields): its copy for the
        text encoder at about areas[0] pixels and its VAE input (1, 3, 1, h, w) at about areas[1], the aspect ratio
        kept and sides multiples of 32 (`calculate_dimensions`), as QwenImageEditPlusPipeline prepares its `image`."""
        if not (isinstance(areas, list) and len(areas) == 2 and all(isinstance(n, int) and 0 < n <= SOURCE_PIXELS
                                                                      for n in areas)):
            raise ValueError(f"extra_params.{KEY}.source_areas must be two pixel counts in [1, {SOURCE_PIXELS}]")
        ratio = image.width / image.height
        (cw, ch), (vw, vh) = (calculate_dimensions(area, ratio) for area in areas)
        return dict(condition_images=[self.image_processor.resize(image, ch, cw)], condition_image_sizes=[(cw, ch)],
                    vae_images=[self.image_processor.preprocess(image, vh, vw).unsqueeze(2)],
                    vae_image_sizes=[(vw, vh)], calculated_width=vw, calculated_height=vh)

    def prepare_latents(self, images, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        """The noise as FlowGRPOSampler draws it (float32, one generator per image), the source's latents in the
        server's dtype (as the trainer's adapter encodes them)."""
        if self._run is None:
            return super().prepare_latents(images, batch_size, num_channels_latents, height, width, dtype, device,
                                           generator, latents)
        noise, _ = super().prepare_latents(None, batch_size, num_channels_latents, height, width, dtype, device,
                                           generator, latents)
        _, source = QwenImageEditPlusPipeline.prepare_latents(self, images, batch_size, num_channels_latents, height,
                                                              width, dtype, device, None, noise)
        return noise, source

    def velocity(self, a: SimpleNamespace):
        if a.image_latents is None:  # the trainer always sends one (models_qwen_edit.QwenImageEdit.omni_knobs)
            raise ValueError(f"FlowGRPOQwenImageEditPlusPipeline edits a source image: extra_params.{KEY}.source is "
                             "missing")
        return qwen_velocity(self, a)

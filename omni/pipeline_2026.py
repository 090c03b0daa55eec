"""vLLM-Omni 0.30.0 custom pipelines of the 2026 families it serves, Z-Image and FLUX.2 [klein], sampled with this
project's sampler (omni.pipeline.FlowGRPOSampler: the same `scheduler.step`, the same knobs and trajectory file).

    PYTHONPATH=<this repo> vllm serve <pipeline dir> --omni --host 127.0.0.1 --dtype float32 --custom-pipeline-args \
        '{"pipeline_class": "omni.pipeline_2026.<CLASS>", "trajectory_root": "/dev/shm/flowgrpo"}'

<CLASS>: the adapter's `omni_pipeline_class` (FlowGRPOZImagePipeline, FlowGRPOFlux2KleinPipeline). Only the server
process imports this module. (vLLM-Omni 0.30.0 has no Qwen-Image 2.1 pipeline: that family samples locally.)

Both parents denoise inside their `forward` (no `diffuse` to replace), so a FlowGRPO request takes `generate` here:
the parent's own prompt encoding, latent preparation, transformer and VAE, called in the parent's order, with our loop
(`FlowGRPOSampler._sample`) between them. Neither parent batches requests (one prompt a pass: serve with the default
--max-num-seqs 1). A request without knobs runs the parent's `forward` unchanged.

vLLM-Omni 0.30.0 defects fixed here: Z-Image builds its transformer at the real model's size whatever the directory's
config says; its σ table ends with a zero step (it sets sigma_min = 0: linspace(1, 0, N) where diffusers' pipeline and
the trainer take linspace(1, 1/N, N); measured at 4 steps: 1, .857, .6, 0, 0 against 1, .9, .75, .5, 0); it loads only
a text encoder saved under the causal LM's parameter names, not one saved as the Qwen3Model its model_index.json names
(as diffusers' save_pretrained writes it). FLUX.2 [klein] encodes "" as the negative prompt whatever the request sends,
and draws its noise in the server's dtype.
"""
from types import SimpleNamespace

import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.flux2_klein.pipeline_flux2_klein import Flux2KleinPipeline
from vllm_omni.diffusion.models.z_image.pipeline_z_image import ZImagePipeline
from vllm_omni.diffusion.models.z_image.z_image_transformer import ZImageTransformer2DModel
from vllm_omni.diffusion.utils.tf_utils import get_transformer_config_kwargs
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

import scheduler as sch
from models_flux2 import klein_scheduler_class
from models_qwen import last_logit_only
from models_zimage import zimage_scheduler_class
from omni.pipeline import FlowGRPOSampler, _prompt_text


def one_request(req: DiffusionRequestBatch, pipeline: str) -> tuple[str, str | None, int]:
    """(prompt, negative prompt or None, n) of a pass's one request."""
    if len(req.requests) != 1:  # vLLM-Omni batches none for these parents (supports_request_batch is False)
        raise ValueError(f"{pipeline} samples one request a pass, got {len(req.requests)}: serve with --max-num-seqs 1")
    prompt, sp = req.prompts[0], req.sampling_params
    negative = None if isinstance(prompt, str) else prompt.get("negative_prompt")
    return _prompt_text(prompt), negative, sp.num_outputs_per_prompt if sp.num_outputs_per_prompt > 0 else 1


def trainer_schedule(scheduler_class: type, config, num_steps: int, image_seq_len: int) -> tuple:
    """(timesteps σ·1000 (N,), σ (N + 1,)), float32, as the trainer's adapter computes them (its scheduler class over
    the served directory's scheduler config): the client checks σ to the bit."""
    sigmas = sch.sigma_schedule(scheduler_class().from_config(config), num_steps, image_seq_len)
    return sigmas[:-1] * config.num_train_timesteps, sigmas


class FlowGRPOZImagePipeline(FlowGRPOSampler, ZImagePipeline):
    """vLLM-Omni's ZImagePipeline with this project's sampler (models_zimage.ZImage's twin): latents (n, C, h, w), the
    transformer on a list of images with time input 1 − σ, its output's negative the velocity, Z-Image's CFG
    v_c + g·(v_c − v_u) with the request's guidance_scale g (the trainer's --cfg-scale w = g + 1) when g > 0."""

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        self.text_encoder.register_forward_pre_hook(last_logit_only, with_kwargs=True)  # its states only are read
        # The parent builds its transformer at Z-Image's size whatever the directory's config says (the weights are
        # not loaded yet, the parameters not yet written): build it from that config, as FLUX.2 [klein]'s parent does
        self.transformer = ZImageTransformer2DModel(quant_config=od_config.quantization_config,
                                                    **get_transformer_config_kwargs(od_config.tf_model_config,
                                                                                    ZImageTransformer2DModel))

    def load_weights(self, weights):
        """The parent builds the text encoder as a causal LM (parameters `model.…`, `lm_head.…`); a directory written
        by diffusers' save_pretrained holds the Qwen3Model that its model_index.json names (parameters `layers.…`):
        load those under the causal LM's names (its lm_head, unused, stays as built)."""
        def renamed():
            for name, tensor in weights:
                part, _, rest = name.partition(".")
                if part == "text_encoder" and not rest.startswith(("model.", "lm_head.")):
                    name = f"text_encoder.model.{rest}"
                yield name, tensor
        return super().load_weights(renamed())

    def generate(self, req: DiffusionRequestBatch, **kwargs):
        """ZImagePipeline.forward's text-to-image path with our loop: prompts encoded (the negative one, "" unless
        sent, when g > 0), noise, each prompt's states repeated n times, the trainer's σ table, the VAE decode."""
        prompt, negative, n = one_request(req, type(self).__name__)
        sp, run, device = req.sampling_params, self._run, self._execution_device
        if sp.cfg_normalize or float(sp.extra_args.get("cfg_truncation", 1.0)) < 1:
            raise ValueError("FlowGRPOZImagePipeline samples with plain CFG: no cfg_normalize, no cfg_truncation")
        guidance = sp.guidance_scale or 0.0
        embeds, neg_embeds = self.encode_prompt(prompt=[prompt], negative_prompt=[negative or ""], device=device,
                                                do_classifier_free_guidance=guidance > 0,
                                                max_sequence_length=run["max_sequence_length"])
        x = self.prepare_latents(n, self.transformer.in_channels, sp.height, sp.width, torch.float32, device, None)
        a = SimpleNamespace(embeds=embeds * n, neg_embeds=neg_embeds * n, guidance=guidance)
        multiple = self.vae_scale_factor * 2
        x = self._sample(x, *trainer_schedule(zimage_scheduler_class, self.scheduler.config, sp.num_inference_steps,
                                              (sp.height // multiple) * (sp.width // multiple)), self.velocity(a))
        z = x.to(self.vae.dtype) / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return DiffusionOutput(output=self.vae.decode(z, return_dict=False)[0],
                               stage_durations=getattr(self, "stage_durations", None))

    def velocity(self, a: SimpleNamespace):
        """v(x, t) (n, C, h, w) as the parent's loop computes it: one transformer call on the list of images (with
        CFG the conditional then the unconditional ones, 2n), its outputs in float32, CFG, the sign flipped."""
        dtype = self.od_config.dtype

        def v(x, t):
            images, texts, time = list(x.to(dtype).unsqueeze(2).unbind(0)), a.embeds, (1000 - t.expand(len(x))) / 1000
            if a.guidance > 0:
                images, texts, time = images + images, a.embeds + a.neg_embeds, time.repeat(2)
            out = torch.stack([o.float() for o in self.transformer(images, time, texts)[0]])
            if a.guidance > 0:
                pos, neg = out.chunk(2)
                out = pos + a.guidance * (pos - neg)
            return -out.squeeze(2)
        return v


class FlowGRPOFlux2KleinPipeline(FlowGRPOSampler, Flux2KleinPipeline):
    """vLLM-Omni's Flux2KleinPipeline with this project's sampler (models_flux2.Flux2Klein's twin): packed latents
    (n, S, 4C), no guidance embedding, two-pass CFG n + s·(p − n) with the request's guidance_scale s and negative
    prompt when s > 1 (not for a step-distilled checkpoint, which the trainer never asks for it)."""

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        self.text_encoder.register_forward_pre_hook(last_logit_only, with_kwargs=True)  # its states only are read

    def generate(self, req: DiffusionRequestBatch, **kwargs):
        """Flux2KleinPipeline.forward's text-to-image path with our loop: the prompt (and with CFG the request's
        negative prompt) encoded n times, the noise in float32 laid out contiguously as the trainer stores it, the
        trainer's σ table (the parent's formula: linspace(1, 1/N, N), FLUX.2's empirical mu), the parent's decode."""
        prompt, negative, n = one_request(req, type(self).__name__)
        sp, run, device = req.sampling_params, self._run, self._execution_device
        self._guidance_scale = sp.guidance_scale
        text = dict(device=device, num_images_per_prompt=n, max_sequence_length=run["max_sequence_length"])
        embeds, text_ids = self.encode_prompt(prompt=prompt, **text)
        neg_embeds = neg_ids = None
        if self.do_classifier_free_guidance:
            neg_embeds, neg_ids = self.encode_prompt(prompt=negative or "", **text)
        x, latent_ids = self.prepare_latents(n, self.transformer.config.in_channels // 4, sp.height, sp.width,
                                             torch.float32, device, None)
        a = SimpleNamespace(embeds=embeds, text_ids=text_ids, neg_embeds=neg_embeds, neg_ids=neg_ids, ids=latent_ids)
        x = self._sample(x.contiguous(), *trainer_schedule(klein_scheduler_class, self.scheduler.config,
                                                           sp.num_inference_steps, x.shape[1]), self.velocity(a))
        z = self._unpack_latents_with_ids(x, latent_ids)  # (n, 4C, h, w): the batch-norm statistics undone
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(z)
        z = z * std + bn.running_mean.view(1, -1, 1, 1).to(z)
        image = self.vae.decode(self._unpatchify_latents(z).to(self.vae.dtype), return_dict=False)[0]
        return DiffusionOutput(output=image, stage_durations=getattr(self, "stage_durations", None))

    def velocity(self, a: SimpleNamespace):
        """v(x, t) (n, S, 4C) as the parent's loop computes it: time input σ·1000 cast to the model dtype, then / 1000;
        CFG through the parent's predict_noise_maybe_with_cfg."""
        dtype, cfg = a.embeds.dtype, self.do_classifier_free_guidance

        def v(x, t):
            pos = dict(hidden_states=x.to(dtype), timestep=t.expand(len(x)).to(dtype) / 1000, guidance=None,
                       encoder_hidden_states=a.embeds, txt_ids=a.text_ids, img_ids=a.ids,
                       joint_attention_kwargs=self.attention_kwargs, return_dict=False)
            neg = dict(pos, encoder_hidden_states=a.neg_embeds, txt_ids=a.neg_ids) if cfg else None
            return self.predict_noise_maybe_with_cfg(cfg, self.guidance_scale, pos, neg, False)
        return v

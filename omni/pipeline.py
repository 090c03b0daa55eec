"""vLLM-Omni 0.30.0 custom pipelines: Qwen-Image, SD3.5, FLUX.1 and Wan2.1 T2V sampled with this project's
`scheduler.step`, each writing the trajectory the trainer needs (rollout.Batch's tensors) to the file a request names.

    PYTHONPATH=<this repo> vllm serve <pipeline dir> --omni --host 127.0.0.1 --dtype float32 --custom-pipeline-args \
        '{"pipeline_class": "omni.pipeline.<CLASS>", "trajectory_root": "/dev/shm/flowgrpo"}'

<CLASS>: the adapter's `omni_pipeline_class` (FlowGRPOQwenImagePipeline, FlowGRPOSD3Pipeline, FlowGRPOFluxPipeline,
FlowGRPOWanPipeline; the edit families' are omni/pipeline_edit.py's, Z-Image's and FLUX.2 [klein]'s
omni/pipeline_2026.py's).
Only the server process imports this module (rollout_backends.py, the client, never imports vllm_omni).

A request opts in with `extra_params = {"flowgrpo": {...}}` (rollout_backends.OmniBackend builds it):
    trajectory    absolute path of the .safetensors file to write (atomically: a temporary name, then
                  os.replace), before the images are returned. Its directory must exist and lie beneath the
                  server's `trajectory_root` (symlinks and `..` resolved): a server without one writes nothing,
                  so no client can make it overwrite a file elsewhere (model weights, say)
    seeds         n ints, one per image: each image's initial noise and SDE noise come from its own CPU
                  generator, drawn exactly as the local backend (rollout.sample) draws them
    steps         the trained step indices (consecutive; [] = pure ODE); noise_level; sde_type
    max_sequence_length  the trainer's text length (its adapter's): T5 pads every prompt to it, so it shapes the
                  conditioning (the request API has no field for it)
    num_frames    frames per sample (a video model's; 1, the default, for images): the image API has no field for it
    source        an edit model's source image, a base64 PNG (omni/pipeline_edit.py): /v1/images/generations
                  takes no image, and /v1/images/edits no extra_params
A request without it (the server's start-up warm-up, a plain generation) runs vLLM-Omni's own sampler and
writes nothing. Everything else (prompt encoding, latent packing, the transformer, CFG, the VAE decode) stays
vLLM-Omni's: only the denoising loop is ours (`FlowGRPOSampler`), plus fixes to three 0.30.0 defects: Qwen-Image's
prompt masks and SD3's conditioning in fused batches of n > 1 images, FLUX's LoRA module names.

The file holds, for n images, W trained steps, latents of shape L per image ((S, C) packed for Qwen-Image and
FLUX, (C, h, w) for SD3, (C, F', h, w) for Wan): latents (n, W+1, *L), log_probs (n, W), sigmas (W+1,), sigma_max (),
images (n, 3, H, W) (videos: (n, F, 3, H, W)) in [0, 1], x0 (n, *L) (the final latents), all float32, and metadata
{"format", "seeds", "prompt"}. No
prompt conditioning: the trainer re-encodes the prompts with its own (identical, frozen) text encoders; the
embeddings would be the largest tensors in the file, and shipping them would hide part of the rollout-vs-trainer
gap that `train/logp_gap` is there to measure.
"""
import contextlib
import inspect
import json
import os
import uuid
from types import SimpleNamespace

import torch
import torch.distributed as dist
from diffusers.utils.torch_utils import randn_tensor
from safetensors.torch import save
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm_omni.diffusion.distributed.parallel_state import (get_classifier_free_guidance_rank,
                                                            get_pipeline_parallel_rank, get_sequence_parallel_rank)
from vllm_omni.diffusion.models.flux.pipeline_flux import FluxPipeline
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
from vllm_omni.diffusion.models.sd3.pipeline_sd3 import StableDiffusion3Pipeline
from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import Wan22Pipeline
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

import scheduler as sch
from models_wan import WAN_SCHEDULER, wan_scheduler_class

KEY = "flowgrpo"  # the extra_params entry that carries our knobs
FORMAT = "flowgrpo-trajectory-v2"
SAMPLER_KNOBS = ("steps", "noise_level", "sde_type", "max_sequence_length", "num_frames")  # one per sampling pass
def expose_flux_lora_names(transformer) -> None:
    """0.30.0's FLUX transformer keeps this mapping local to load_weights (SD3's and Qwen-Image's expose it): its LoRA
    manager then refuses to_q/k/v, add_q/k/v_proj (diffusers' names, Flow-GRPO's targets). Expose it."""
    transformer.stacked_params_mapping = [  # (fused module, diffusers' module, shard)
        (".to_qkv", ".to_q", "q"), (".to_qkv", ".to_k", "k"), (".to_qkv", ".to_v", "v"),
        (".add_kv_proj", ".add_q_proj", "q"), (".add_kv_proj", ".add_k_proj", "k"),
        (".add_kv_proj", ".add_v_proj", "v")]


def writes_trajectories() -> bool:
    """Whether this rank writes its passes' trajectory files: the primary of its data-parallel replica (SP, CFG, TP and
    PP rank 0), the rank whose outputs the executor returns (global rank r·replica size for replica r; the replica's
    other ranks hold the same tensors). Global rank 0 alone wrote none for the requests of replicas 1, 2, … (a server
    on several devices infers data parallelism from the world size)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    return all(rank() == 0 for rank in (get_sequence_parallel_rank, get_classifier_free_guidance_rank,
                                        get_tensor_model_parallel_rank, get_pipeline_parallel_rank))


def checked_root(custom_pipeline_args: dict | None) -> str | None:
    """The server's `trajectory_root` (symlinks resolved), checked at start-up; None: it writes no trajectories."""
    root = (custom_pipeline_args or {}).get("trajectory_root")
    if root is not None and not (isinstance(root, str) and os.path.isabs(root) and os.path.isdir(root)):
        raise ValueError(f"--custom-pipeline-args: trajectory_root must be an existing directory's absolute path, "
                         f"got {root!r}")
    return root and os.path.realpath(root)


def place(path, root: str | None, pipeline: str) -> tuple[str, str]:
    """(directory relative to `root`, file name) of a trajectory path, refused unless its directory exists and,
    symlinks and `..` resolved, lies beneath `root`."""
    if root is None:
        raise ValueError("this server has no trajectory_root, so it writes no trajectory files: start it with "
                         f"--custom-pipeline-args '{{\"pipeline_class\": \"{pipeline}\", "
                         "\"trajectory_root\": \"/DIR\"}', /DIR holding the trainers' FLOWGRPO_ROLLOUT_DIR "
                         "(docs/vllm-omni.md)")
    if not (isinstance(path, str) and os.path.isabs(path) and path.endswith(".safetensors")):
        raise ValueError(f"extra_params.{KEY}.trajectory must be an absolute *.safetensors path, got {path!r}")
    folder, name = os.path.split(path)
    rel = os.path.relpath(os.path.realpath(folder), root)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"trajectory path {path} is not beneath this server's trajectory_root {root} (symlinks and "
                         "'..' resolved): set the trainer's FLOWGRPO_ROLLOUT_DIR (default: its run directory) to a "
                         "directory beneath it")
    if not os.path.isdir(os.path.join(root, rel)):
        raise ValueError(f"trajectory path {path}: no such directory on this server (the trainer creates it; both "
                         "must see the same filesystem at the same path)")
    return rel, name


def parse_knobs(extra_args: dict | None, n: int, num_steps: int | None, root: str | None,
                pipeline: str, known: tuple = ()) -> dict | None:
    """This request's knobs from extra_params["flowgrpo"], checked (None: not a FlowGRPO request); `known`: those the
    pipeline reads besides the sampler's (an edit family's source)."""
    knobs = (extra_args or {}).get(KEY)
    if knobs is None:
        return None
    knobs = {"num_frames": 1, **knobs}
    missing = [k for k in ("trajectory", "seeds", *SAMPLER_KNOBS) if k not in knobs]
    if missing:
        raise ValueError(f"extra_params.{KEY} lacks {missing}")
    unread = sorted(set(knobs) - {"trajectory", "seeds", *SAMPLER_KNOBS, *known})
    if unread:  # else dropped: an edit model's source sent to a text-to-image class, its rollout taken as an edit's
        raise ValueError(f"extra_params.{KEY} has {unread}, which {pipeline} does not read: serve the class of the "
                         "trainer's --model (its adapter's omni_pipeline_class, docs/vllm-omni.md)")
    if not num_steps:  # the pipelines' defaults differ (50, 28): the trainer's σ schedule needs its own count
        raise ValueError("a FlowGRPO request must set num_inference_steps")
    where, steps = place(knobs["trajectory"], root, pipeline), list(knobs["steps"])
    seeds, text_length = [int(s) for s in knobs["seeds"]], int(knobs["max_sequence_length"])
    if len(seeds) != n:
        raise ValueError(f"extra_params.{KEY}.seeds has {len(seeds)} seeds for n = {n} images")
    if steps and (steps != list(range(steps[0], steps[0] + len(steps))) or steps[0] < 0 or steps[-1] > num_steps - 2):
        raise ValueError(f"steps {steps} must be consecutive within [0, {num_steps - 2}] for {num_steps} steps")
    if steps and not float(knobs["noise_level"]) > 0:
        raise ValueError(f"noise_level must be > 0 on trained steps, got {knobs['noise_level']}")
    if knobs["sde_type"] not in sch.SDE_TYPES:
        raise ValueError(f"sde_type must be one of {sch.SDE_TYPES}, got {knobs['sde_type']!r}")
    if not 0 < text_length <= 1024:
        raise ValueError(f"max_sequence_length must be in [1, 1024], got {text_length}")
    if not (isinstance(knobs["num_frames"], int) and 0 < knobs["num_frames"] <= 1024):
        raise ValueError(f"num_frames must be an int in [1, 1024], got {knobs['num_frames']!r}")
    return dict(knobs, where=where, steps=steps, seeds=seeds, noise_level=float(knobs["noise_level"]),
                max_sequence_length=text_length)


class FlowGRPOSampler:
    """What the three pipelines share, placed before vLLM-Omni's pipeline among their bases: the knobs, float32
    noise from one CPU generator per image, our sampling loop in place of the parent's `diffuse`, one trajectory
    file per request. A family adds `velocity`: the transformer call with its conditioning and CFG, as its
    parent's `diffuse` makes it."""
    # Step mode (prepare_encode/denoise_step/...) would bypass `diffuse` and record nothing: request mode only.
    supports_step_execution = False
    extra_knobs: tuple = ()  # the knobs a family reads besides the sampler's (an edit family's source)
    _run: dict | None = None  # the pass in progress: generators, knobs, then the recorded tensors

    def __init__(self, *, od_config, prefix: str = ""):
        root = checked_root(od_config.custom_pipeline_args)  # a bad trajectory_root fails before the weights load
        super().__init__(od_config=od_config, prefix=prefix)
        self.trajectory_root = root

    def forward(self, req: DiffusionRequestBatch, **kwargs):  # kwargs: the parent's (Kontext: the source image)
        params = req.sampling_params_list
        n = params[0].num_outputs_per_prompt if params[0].num_outputs_per_prompt > 0 else 1
        name = f"{type(self).__module__}.{type(self).__name__}"
        knobs = [parse_knobs(sp.extra_args, n, sp.num_inference_steps, self.trajectory_root, name, self.extra_knobs)
                 for sp in params]
        # vLLM-Omni batches requests that agree on size/steps/n/LoRA but not on our knobs: a mixed batch
        # is sampled one request at a time (each request's outputs stay in its own order).
        if len({json.dumps(k and [k[s] for s in SAMPLER_KNOBS]) for k in knobs}) > 1:
            return [out for r in req.requests for out in self.forward(DiffusionRequestBatch(requests=[r]))]
        if knobs[0] is None:
            return super().forward(req, **kwargs)
        # Rows of the batch are [request 0 × n, request 1 × n, …], as the conditioning is repeated.
        self._run = dict(knobs[0], gens=[torch.Generator().manual_seed(s) for k in knobs for s in k["seeds"]])
        try:
            outputs = self.generate(req, **kwargs)
            run = self._run
        finally:
            self._run = None
        if writes_trajectories():  # one rank of the replica that sampled this pass
            # one output per request; a pipeline without request batching (Kontext) returns its one request's
            for i, (k, out) in enumerate(zip(knobs, outputs if isinstance(outputs, list) else [outputs])):
                rows = slice(i * n, (i + 1) * n)
                # out.output: (n, 3, H, W) in [-1, 1]; [0, 1] as VaeImageProcessor.postprocess(output_type="pt")
                images = (self.samples(out).float() / 2 + 0.5).clamp(0, 1)
                write_trajectory(self.trajectory_root, *k["where"], {
                    "latents": run["latents"][rows], "log_probs": run["log_probs"][rows], "sigmas": run["sigmas"],
                    "sigma_max": torch.tensor(run["sigma_max"]), "images": images, "x0": run["x0"][rows]},
                    {"format": FORMAT, "seeds": json.dumps(k["seeds"]), "prompt": _prompt_text(req.prompts[i])})
        return outputs

    def generate(self, req: DiffusionRequestBatch, **kwargs):
        """One pass with this request's knobs in `_run`: the parent's `forward`, whose `diffuse` is ours (a parent that
        denoises inside its `forward`, omni/pipeline_2026.py's, replaces this)."""
        return super().forward(req, **kwargs)

    def prepare_latents(self, *args, **kwargs):
        """x at σ = 1 in float32 from one generator per image, as the adapter's `noise` draws it (Qwen-Image, FLUX:
        (B·n, S, C) packed; FLUX's image ids come along). The request's own generator (one per request, shared by
        its n images) and the server's dtype are not used."""
        if self._run is None:
            return super().prepare_latents(*args, **kwargs)
        bound = inspect.signature(super().prepare_latents).bind(*args, **kwargs)
        bound.arguments.update(dtype=torch.float32, generator=self._run["gens"])
        return super().prepare_latents(*bound.args, **bound.kwargs)

    def encode_prompt(self, *args, **kwargs):
        if self._run is not None:  # every parent passes it by name
            kwargs["max_sequence_length"] = self._run["max_sequence_length"]
        return super().encode_prompt(*args, **kwargs)

    def diffuse(self, *args, **kwargs):
        if self._run is None:
            return super().diffuse(*args, **kwargs)
        # The parent's arguments by name (Qwen-Image's and FLUX's `forward` pass them by position, SD3's by name)
        bound = inspect.signature(super().diffuse).bind(*args, **kwargs)
        bound.apply_defaults()
        a = SimpleNamespace(**bound.arguments)
        return self._sample(a.latents, *self.schedule(a), self.velocity(a))

    def samples(self, out) -> torch.Tensor:
        """The decoded images of one request's output, (n, 3, H, W) in [-1, 1]."""
        return out.output

    def schedule(self, a: SimpleNamespace) -> tuple:
        """(timesteps (N,), σ (N + 1,)) of this pass: the parent's `prepare_timesteps` set them for this request."""
        return a.timesteps, self.scheduler.sigmas.float().cpu()

    def _sample(self, latents: torch.Tensor, timesteps, sigmas, velocity) -> torch.Tensor:
        """rollout.sample's loop on a float32 state x (B·n, *L), velocity(x, t) -> v (B·n, *L): SDE (recorded) on the
        trained steps, ODE elsewhere. σ_0 … σ_N (last 0) and timesteps σ_i·1000 come from the parent's
        `prepare_timesteps` for this request, as scheduler.sigma_schedule (the client checks them to the bit)."""
        run = self._run
        steps, sigma_max = run["steps"], float(sigmas[1])
        x, states, log_probs = latents.float(), [], []
        for i, t in enumerate(timesteps):
            self._current_timestep = t
            v = velocity(x, t)
            sde = i in steps
            if sde and not states:
                states.append(x)
            x, log_prob, _, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=sigma_max,
                                         noise_level=run["noise_level"] if sde else 0, sde_type=run["sde_type"],
                                         generator=run["gens"])
            if sde:
                states.append(x)
                log_probs.append(log_prob)
        self._current_timestep = None
        B = x.shape[0]
        run.update(latents=torch.stack(states, 1).cpu() if states else x.new_zeros(B, 0, *x.shape[1:]).cpu(),
                   log_probs=torch.stack(log_probs, 1).cpu() if log_probs else torch.zeros(B, 0),
                   sigmas=sigmas[steps[0]:steps[-1] + 2] if steps else sigmas[:0], sigma_max=sigma_max, x0=x.cpu())
        return x.to(latents.dtype)


def qwen_velocity(pipe, a: SimpleNamespace):
    """v(x, t) (B·n, S, C) as Qwen-Image's `diffuse` computes it: vLLM-Omni's true CFG n + s·(p − n), rescaled to the
    conditional norm per token, when a negative prompt is given with true_cfg_scale > 1; an edit model's on [x, source]
    (B·n, S + S', C), its output's first S tokens."""
    pipe.transformer.do_true_cfg = a.do_true_cfg
    dtype = a.prompt_embeds.dtype  # the transformer's; the state x stays float32 (as in rollout.sample)

    def v(x, t):
        hidden = x.to(dtype) if a.image_latents is None else torch.cat([x.to(dtype), a.image_latents], 1)
        pos = dict(hidden_states=hidden, timestep=t.expand(x.shape[0]).to(x.device, dtype) / 1000,
                   guidance=a.guidance, encoder_hidden_states_mask=a.prompt_embeds_mask,
                   encoder_hidden_states=a.prompt_embeds, img_shapes=a.img_shapes, txt_seq_lens=a.txt_seq_lens,
                   **(a.additional_transformer_kwargs or {}))
        neg = dict(pos, encoder_hidden_states_mask=a.negative_prompt_embeds_mask,
                   encoder_hidden_states=a.negative_prompt_embeds, txt_seq_lens=a.negative_txt_seq_lens)
        return pipe.predict_noise_maybe_with_cfg(a.do_true_cfg, a.true_cfg_scale, pos, neg if a.do_true_cfg else None,
                                                 a.cfg_normalize, output_slice=x.shape[1])
    return v


class FlowGRPOQwenImagePipeline(FlowGRPOSampler, QwenImagePipeline):
    """vLLM-Omni's QwenImagePipeline with this project's sampler (models.QwenImage's twin on the server)."""

    def encode_prompt(self, prompt, num_images_per_prompt=1, prompt_embeds=None, prompt_embeds_mask=None,
                      max_sequence_length=1024, prompt_name="prompt"):
        # vLLM-Omni 0.30.0 (as diffusers) repeats the (B, L) mask with `.repeat(1, n, 1).view(B·n, L)`, which
        # interleaves it ([m0, m1, m0, m1, …]) while the embeddings come request-major ([e0, e0, …, e1, e1, …]):
        # in a fused batch of requests whose prompts differ in length, with n > 1, rows get another prompt's
        # mask (measured: latents off by 1e-2). Encode once per prompt, then repeat both row by row.
        embeds, mask = super().encode_prompt(prompt=prompt, num_images_per_prompt=1, prompt_embeds=prompt_embeds,
                                             prompt_embeds_mask=prompt_embeds_mask,
                                             max_sequence_length=max_sequence_length, prompt_name=prompt_name)
        return embeds.repeat_interleave(num_images_per_prompt, 0), mask.repeat_interleave(num_images_per_prompt, 0)

    def velocity(self, a: SimpleNamespace):
        if a.image_latents is not None:
            raise ValueError("FlowGRPOQwenImagePipeline samples text-to-image only (no image latents)")
        return qwen_velocity(self, a)


class FlowGRPOSD3Pipeline(FlowGRPOSampler, StableDiffusion3Pipeline):
    """vLLM-Omni's StableDiffusion3Pipeline (SD3.5) with this project's sampler (models_sd3.SD3's twin)."""

    def prepare_latents(self, batch_size, num_channels_latents, height, width, generator, latents=None):
        if self._run is None:
            return super().prepare_latents(batch_size, num_channels_latents, height, width, generator, latents)
        # (B·n, C, H/f, W/f), as models_sd3.SD3.noise: the parent has no dtype argument (it draws in the server's)
        f = self.vae_scale_factor
        return randn_tensor((batch_size, num_channels_latents, int(height) // f, int(width) // f),
                            generator=self._run["gens"], device=self.device, dtype=torch.float32)

    def velocity(self, a: SimpleNamespace):
        """v(x, t) (B·n, C, h, w) as StableDiffusion3Pipeline.diffuse computes it: CFG n + s·(p − n) when
        guidance_scale > 1 (two passes, where the trainer batches them: the same arithmetic)."""
        # 0.30.0's SD3 `forward` encodes each prompt once, not n times (a fused batch of n > 1 fails): repeat each
        # prompt's rows n times, request-major as the latents
        n = a.latents.shape[0] // a.prompt_embeds.shape[0]
        embeds, pooled, neg_embeds, neg_pooled = (
            None if c is None else c.repeat_interleave(n, 0)
            for c in (a.prompt_embeds, a.pooled_prompt_embeds, a.negative_prompt_embeds,
                      a.negative_pooled_prompt_embeds))
        dtype = embeds.dtype

        def v(x, t):
            # timestep σ·1000 in float32, as the trainer and diffusers' pipeline feed it (the parent casts it to the
            # server's dtype, which in bf16 rounds 1000·σ to a step of up to 4)
            pos = dict(hidden_states=x.to(dtype), timestep=t.expand(x.shape[0]).to(x.device, torch.float32),
                       encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)
            neg = dict(pos, encoder_hidden_states=neg_embeds, pooled_projections=neg_pooled)
            return self.predict_noise_maybe_with_cfg(a.do_true_cfg, a.guidance_scale, pos,
                                                     neg if a.do_true_cfg else None, a.cfg_normalize)
        return v


def flux_velocity(pipe, a: SimpleNamespace, img_ids, source=None):
    """v(x, t) (B·n, S, 4C) as FLUX's `diffuse` computes it: one pass with the guidance embedding; Kontext's on
    [x, source] (B·n, 2S, 4C) with the source's ids after x's, its output's first S tokens."""
    if a.do_true_cfg:  # the trainer never asks for it (model_checks.check_model_args: --cfg-scale 1 for FLUX)
        raise ValueError(f"{type(pipe).__name__} samples with the guidance embedding only: no true_cfg_scale > 1 with "
                         "a negative prompt")
    pipe.transformer.do_true_cfg = False
    dtype = a.prompt_embeds.dtype

    def v(x, t):
        hidden = x.to(dtype) if source is None else torch.cat([x.to(dtype), source], 1)
        pos = dict(hidden_states=hidden, timestep=t.expand(x.shape[0]).to(x.device, dtype) / 1000, guidance=a.guidance,
                   pooled_projections=a.pooled_prompt_embeds, encoder_hidden_states=a.prompt_embeds,
                   txt_ids=a.text_ids, img_ids=img_ids, joint_attention_kwargs=pipe.joint_attention_kwargs,
                   return_dict=False)
        return pipe.predict_noise_maybe_with_cfg(False, a.true_cfg_scale, pos, None, False, output_slice=x.shape[1])
    return v


class FlowGRPOFluxPipeline(FlowGRPOSampler, FluxPipeline):
    """vLLM-Omni's FluxPipeline (FLUX.1-dev) with this project's sampler (models_flux.Flux's twin)."""

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__(od_config=od_config, prefix=prefix)
        expose_flux_lora_names(self.transformer)

    def velocity(self, a: SimpleNamespace):
        return flux_velocity(self, a, a.latent_image_ids)


class FlowGRPOWanPipeline(FlowGRPOSampler, Wan22Pipeline):
    """vLLM-Omni's Wan pipeline (it serves WanPipeline directories) for Wan2.1 text-to-video, with this project's
    sampler (models_wan.Wan's twin): the trainer's Euler σ table (models_wan.WAN_SCHEDULER) in place of the server's
    UniPC one, the request's num_frames knob, the videos from the output's media."""

    def forward(self, req: DiffusionRequestBatch):
        for sp in req.sampling_params_list:  # the image API has no frame count: the knob sets it
            if KEY in (sp.extra_args or {}):
                sp.num_frames = sp.extra_args[KEY].get("num_frames", 1)
        return super().forward(req)

    def samples(self, out) -> torch.Tensor:
        return out.media.video.tensor.transpose(1, 2)  # (n, C, F, H, W) -> (n, F, C, H, W), as the trainer's decode

    def schedule(self, a: SimpleNamespace) -> tuple:
        sigmas = sch.sigma_schedule(wan_scheduler_class()(**WAN_SCHEDULER), len(a.timesteps), 0)
        return sigmas[:-1] * WAN_SCHEDULER["num_train_timesteps"], sigmas  # = that scheduler's timesteps, float32

    def velocity(self, a: SimpleNamespace):
        """v(x, t) (B·n, C, F', h, w) as Wan22Pipeline.diffuse computes it with one transformer (Wan2.1): CFG
        n + s·(p − n) in two passes when guidance_scale > 1 and a negative prompt is encoded."""
        if self.transformer_2 is not None or a.latent_condition is not None:
            raise ValueError("FlowGRPOWanPipeline samples Wan2.1 text-to-video only (one transformer, no image)")
        cfg = a.guidance_low > 1 and a.negative_prompt_embeds is not None

        def v(x, t):
            # timestep σ·1000 in float32, as the trainer and diffusers' pipeline feed it
            pos = dict(hidden_states=x.to(a.dtype), timestep=t.expand(x.shape[0]).to(x.device, torch.float32),
                       encoder_hidden_states=a.prompt_embeds, attention_kwargs=a.attention_kwargs,
                       return_dict=False, current_model=self.transformer)
            neg = dict(pos, encoder_hidden_states=a.negative_prompt_embeds)
            return self.predict_noise_maybe_with_cfg(cfg, a.guidance_low, pos, neg if cfg else None, False)
        return v


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else (prompt.get("prompt") or "")


def write_trajectory(root: str, rel: str, name: str, tensors: dict, metadata: dict) -> None:
    """safetensors `root/rel/name`, atomically (a new temporary name, then os.replace: the client never sees a
    partial file). Each directory below `root` is opened without following symlinks, so one swapped for a
    symlink after `place` checked it is an error, not a way out of `root`."""
    data = save({k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in [] if rel == os.curdir else rel.split(os.sep):
            sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = sub
        tmp = f".{name}.{uuid.uuid4().hex[:8]}.tmp"  # O_EXCL: never opens what is already there (a FIFO, a link)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=fd), "wb") as f:
            try:
                f.write(data)
                f.flush()
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:  # a full /dev/shm: the partial file would keep the next writes failing
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=fd)
                raise
    finally:
        os.close(fd)

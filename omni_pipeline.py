"""The vLLM-Omni 0.30.0 custom pipeline: Qwen-Image sampled with this project's `scheduler.step`, writing the
trajectory the trainer needs (rollout.Batch's tensors) to the file a request names.

    PYTHONPATH=<this repo> vllm serve <pipeline dir> --omni --dtype float32 --custom-pipeline-args \
        '{"pipeline_class": "omni_pipeline.FlowGRPOQwenImagePipeline", "trajectory_root": "/dev/shm/flowgrpo"}'

It lives in its own module, not beside its client in rollout.py, so that rollout.py (imported by the trainer
and by the CPU test suite) never imports vllm_omni: only the server process imports this file.

A request opts in with `extra_params = {"flowgrpo": {...}}` (rollout.OmniBackend builds it):
    trajectory    absolute path of the .safetensors file to write (atomically: a temporary name, then
                  os.replace), before the images are returned. Its directory must exist and lie beneath the
                  server's `trajectory_root` (symlinks and `..` resolved): a server without one writes nothing,
                  so no client can make it overwrite a file elsewhere (model weights, say)
    seeds         n ints, one per image: each image's initial noise and SDE noise come from its own CPU
                  generator, drawn exactly as the local backend (rollout.sample) draws them
    steps         the trained step indices (consecutive; [] = pure ODE); noise_level; sde_type
A request without it (the server's start-up warm-up, a plain generation) runs vLLM-Omni's own sampler and
writes nothing. Everything else (prompt encoding, latent packing, the transformer, true CFG with its norm
rescale, the VAE decode) stays vLLM-Omni's: only the denoising loop is ours, plus one fix to how prompt
masks are repeated for n images per prompt (`encode_prompt`), which every request gets.

The file holds, for a request of n images with W trained steps, S latent tokens, C channels:
    latents (n, W+1, S, C), log_probs (n, W), sigmas (W+1,), sigma_max (), images (n, 3, H, W) in [0, 1]
all float32, and metadata {"format", "seeds", "prompt"} for the client's checks. No prompt conditioning:
the trainer re-encodes the prompts with its own (identical, frozen) text encoder. Embeddings would be the
largest tensors in the file (L×D per image, D = 3584 for Qwen-Image) and the trainer needs its own anyway:
its new-policy log-probs must come from its own stack, and shipping the server's conditioning would hide
part of the rollout-vs-trainer gap that `train/logp_gap` is there to measure.
"""
import json
import os
import uuid

import torch
import torch.distributed as dist
from safetensors.torch import save
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import QwenImagePipeline
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

import scheduler as sch

KEY = "flowgrpo"  # the extra_params entry that carries our knobs
FORMAT = "flowgrpo-trajectory-v1"
SAMPLER_KNOBS = ("steps", "noise_level", "sde_type")  # shared by all requests sampled in one pass


def checked_root(custom_pipeline_args: dict | None) -> str | None:
    """The server's `trajectory_root` (symlinks resolved), checked at start-up; None: it writes no trajectories."""
    root = (custom_pipeline_args or {}).get("trajectory_root")
    if root is not None and not (isinstance(root, str) and os.path.isabs(root) and os.path.isdir(root)):
        raise ValueError(f"--custom-pipeline-args: trajectory_root must be an existing directory's absolute path, "
                         f"got {root!r}")
    return root and os.path.realpath(root)


def place(path, root: str | None) -> tuple[str, str]:
    """(directory relative to `root`, file name) of a trajectory path, refused unless its directory exists and,
    symlinks and `..` resolved, lies beneath `root`."""
    if root is None:
        raise ValueError("this server has no trajectory_root, so it writes no trajectory files: start it with "
                         "--custom-pipeline-args '{\"pipeline_class\": \"omni_pipeline.FlowGRPOQwenImagePipeline\", "
                         "\"trajectory_root\": \"/DIR\"}', /DIR holding the trainers' FLOWGRPO_ROLLOUT_DIR (README)")
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


def parse_knobs(extra_args: dict | None, n: int, num_steps: int, root: str | None) -> dict | None:
    """This request's knobs from extra_params["flowgrpo"], checked (None: not a FlowGRPO request)."""
    knobs = (extra_args or {}).get(KEY)
    if knobs is None:
        return None
    missing = [k for k in ("trajectory", "seeds", *SAMPLER_KNOBS) if k not in knobs]
    if missing:
        raise ValueError(f"extra_params.{KEY} lacks {missing}")
    where, steps, seeds = place(knobs["trajectory"], root), list(knobs["steps"]), [int(s) for s in knobs["seeds"]]
    if len(seeds) != n:
        raise ValueError(f"extra_params.{KEY}.seeds has {len(seeds)} seeds for n = {n} images")
    if steps and (steps != list(range(steps[0], steps[0] + len(steps))) or steps[0] < 0 or steps[-1] > num_steps - 2):
        raise ValueError(f"steps {steps} must be consecutive within [0, {num_steps - 2}] for {num_steps} steps")
    if steps and not float(knobs["noise_level"]) > 0:
        raise ValueError(f"noise_level must be > 0 on trained steps, got {knobs['noise_level']}")
    if knobs["sde_type"] not in sch.SDE_TYPES:
        raise ValueError(f"sde_type must be one of {sch.SDE_TYPES}, got {knobs['sde_type']!r}")
    return dict(knobs, where=where, steps=steps, seeds=seeds, noise_level=float(knobs["noise_level"]))


class FlowGRPOQwenImagePipeline(QwenImagePipeline):
    """vLLM-Omni's QwenImagePipeline with this project's SDE/CPS sampler and a trajectory file per request."""
    # Step mode (prepare_encode/denoise_step/...) would bypass `diffuse` and record nothing: request mode only.
    supports_step_execution = False
    _run: dict | None = None  # the pass in progress: generators, knobs, then the recorded tensors

    def __init__(self, *, od_config, prefix: str = ""):
        root = checked_root(od_config.custom_pipeline_args)  # a bad trajectory_root fails before the weights load
        super().__init__(od_config=od_config, prefix=prefix)
        self.trajectory_root = root

    def forward(self, req: DiffusionRequestBatch):
        params = req.sampling_params_list
        n = params[0].num_outputs_per_prompt if params[0].num_outputs_per_prompt > 0 else 1
        knobs = [parse_knobs(sp.extra_args, n, sp.num_inference_steps or 50, self.trajectory_root) for sp in params]
        # vLLM-Omni batches requests that agree on size/steps/n/LoRA but not on our knobs: a mixed batch
        # is sampled one request at a time (each request's outputs stay in its own order).
        if len({json.dumps(k and [k[s] for s in SAMPLER_KNOBS]) for k in knobs}) > 1:
            return [out for r in req.requests for out in self.forward(DiffusionRequestBatch(requests=[r]))]
        if knobs[0] is None:
            return super().forward(req)
        # Rows of the batch are [request 0 × n, request 1 × n, …], as encode_prompt (below) repeats them.
        self._run = dict(knobs[0], gens=[torch.Generator().manual_seed(s) for k in knobs for s in k["seeds"]])
        try:
            outputs = super().forward(req)
            run = self._run
        finally:
            self._run = None
        # The runner returns the outputs of global rank 0 only (diffusion_model_runner.py, `is_primary`);
        # with several devices (TP/SP/CFG-parallel) every rank holds the same tensors, so rank 0 writes.
        if not dist.is_initialized() or dist.get_rank() == 0:
            for i, (k, out) in enumerate(zip(knobs, outputs)):
                rows = slice(i * n, (i + 1) * n)
                # out.output: (n, 3, H, W) in [-1, 1]; [0, 1] as VaeImageProcessor.postprocess(output_type="pt")
                images = (out.output.float() / 2 + 0.5).clamp(0, 1)
                write_trajectory(self.trajectory_root, *k["where"], {
                    "latents": run["latents"][rows], "log_probs": run["log_probs"][rows], "sigmas": run["sigmas"],
                    "sigma_max": torch.tensor(run["sigma_max"]), "images": images},
                    {"format": FORMAT, "seeds": json.dumps(k["seeds"]), "prompt": _prompt_text(req.prompts[i])})
        return outputs

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

    def prepare_latents(self, batch_size, num_channels_latents, height, width, dtype, device, generator,
                        latents=None):
        if self._run is None:
            return super().prepare_latents(batch_size, num_channels_latents, height, width, dtype, device,
                                           generator, latents)
        # x at σ = 1 in float32 from one generator per image, exactly as models.QwenImage.noise draws it:
        # (B·n, S, C) packed. The request's own generator (one per request, shared by its n images) is unused.
        return super().prepare_latents(batch_size, num_channels_latents, height, width, torch.float32, device,
                                       self._run["gens"], latents)

    def diffuse(self, prompt_embeds, prompt_embeds_mask, negative_prompt_embeds, negative_prompt_embeds_mask,
                latents, img_shapes, txt_seq_lens, negative_txt_seq_lens, timesteps, do_true_cfg, guidance,
                true_cfg_scale, image_latents=None, cfg_normalize=True, additional_transformer_kwargs=None):
        run = self._run
        if run is None:
            return super().diffuse(prompt_embeds, prompt_embeds_mask, negative_prompt_embeds,
                                   negative_prompt_embeds_mask, latents, img_shapes, txt_seq_lens,
                                   negative_txt_seq_lens, timesteps, do_true_cfg, guidance, true_cfg_scale,
                                   image_latents, cfg_normalize, additional_transformer_kwargs)
        if image_latents is not None:
            raise ValueError("FlowGRPOQwenImagePipeline samples text-to-image only (no image latents)")
        # σ_0 … σ_N (N + 1, last 0), timesteps = σ_i · 1000: set for this request by prepare_timesteps, with the
        # shift and terminal stretch of scheduler.sigma_schedule (the client requires the same σ to the bit).
        sigmas = self.scheduler.sigmas.float().cpu()
        steps, sigma_max = run["steps"], float(sigmas[1])
        self.transformer.do_true_cfg = do_true_cfg
        dtype = prompt_embeds.dtype  # the transformer's; the state x stays float32 (as in rollout.sample)
        x, states, log_probs = latents.float(), [], []
        for i, t in enumerate(timesteps):
            self._current_timestep = t
            pos = dict(hidden_states=x.to(dtype), timestep=t.expand(x.shape[0]).to(x.device, dtype) / 1000,
                       guidance=guidance, encoder_hidden_states_mask=prompt_embeds_mask,
                       encoder_hidden_states=prompt_embeds, img_shapes=img_shapes, txt_seq_lens=txt_seq_lens,
                       **(additional_transformer_kwargs or {}))
            neg = dict(pos, encoder_hidden_states_mask=negative_prompt_embeds_mask,
                       encoder_hidden_states=negative_prompt_embeds, txt_seq_lens=negative_txt_seq_lens) \
                if do_true_cfg else None
            # v: (B, S, C), vLLM-Omni's true CFG (n + s·(p − n), rescaled to the conditional norm per token)
            v = self.predict_noise_maybe_with_cfg(do_true_cfg, true_cfg_scale, pos, neg, cfg_normalize)
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
                   sigmas=sigmas[steps[0]:steps[-1] + 2] if steps else sigmas[:0], sigma_max=sigma_max)
        return x.to(latents.dtype)


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
            f.write(data)
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    finally:
        os.close(fd)

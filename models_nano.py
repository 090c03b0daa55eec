"""The laptop tasks' models (tasks/nano.py): Qwen-Image's classes at toy size with the tiny model's frozen text encoder,
tokenizer and scheduler, their VAE and transformer pretrained here and shipped in assets/ (diffusers' format,
float16). `--model nano` asks for one handwritten digit at 16×16."""
import os

import torch

import source_images
from models_qwen import QwenImage, build_tiny_qwen_pipeline

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
NANO_DIR = os.path.join(ASSETS, "nano")  # `python -m tasks.nano pretrain` writes it


def build_nano_pipeline(path: str | None = NANO_DIR, vae=None, transformer=None):
    """The nano model (tasks/nano.py): the tiny pipeline's frozen text encoder, tokenizer and scheduler (seed 0, always: the
    condition it was pretrained on), with the VAE and transformer trained on handwritten digits, read from `path`
    (vae/, transformer/), or the modules given (pretraining)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    tiny = build_tiny_qwen_pipeline(0)
    if path is not None:
        vae = AutoencoderKLQwenImage.from_pretrained(os.path.join(path, "vae"), torch_dtype=torch.float32)
        transformer = QwenImageTransformer2DModel.from_pretrained(os.path.join(path, "transformer"),
                                                                  torch_dtype=torch.float32)
    return QwenImagePipeline(scheduler=tiny.scheduler, vae=vae, text_encoder=tiny.text_encoder,
                             tokenizer=tiny.tokenizer, transformer=transformer)


class NanoQwenImage(QwenImage):
    """`nano`: Qwen-Image's classes at toy size, pretrained on real handwritten digits (tasks/nano.py, docs/algorithm.md
    §15); --model-path is a directory of its trained parts (default: the shipped assets/nano)."""
    default_path = NANO_DIR
    trained_classes = {"vae": "AutoencoderKLQwenImage", "transformer": "QwenImageTransformer2DModel"}  # what it loads
    pretrained_by = "tasks.nano pretrain"  # `python -m` this with --out DIR writes its directory

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, guidance: float | None = None) -> QwenImage:
        return cls(build_nano_pipeline(path or cls.default_path), device, torch.float32)


class NanoComposeQwenImage(NanoQwenImage):
    """`nano-compose`: GenEval's questions at 32×32 (tasks/nano_compose.py, docs/tasks.md): the same classes, a VAE 4× down
    to 8 channels and a transformer of 16 tokens, pretrained on rendered compositions; only 32×32, what its judge
    reads."""
    default_path = os.path.join(ASSETS, "nano-compose")
    pretrained_by = "tasks.nano_compose pretrain"
    side = 32

    @classmethod
    def check_size(cls, model: str, spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        if (height, width) != (cls.side, cls.side):
            raise ValueError(f"--model {model} draws {cls.side}×{cls.side} images (its canvas, which its judge and "
                             f"reward read): --height {cls.side} --width {cls.side}, got {height}×{width}")


class NanoEdit(NanoQwenImage):
    """`nano-edit`: edit a handwritten digit as an instruction says (tasks/nano_edit.py, docs/tasks.md), nano's classes with
    the transformer call of diffusers' QwenImageEditPlusPipeline: the source's VAE latents (the posterior's mode,
    normalised, packed: `cond["source"]` (B, S, C·4)) join the sequence after the S noisy tokens, `img_shapes` lists
    both images (the source's rotary positions are its grid at frame index 1), and the velocity is the first S output
    tokens. One departure: the text encoder reads the instruction alone (Qwen-Image-Edit's Qwen2.5-VL also sees the
    image), as this toy's frozen random text encoder has no trained vision; the image reaches the model only as latents.
    The source arrives as a path in the prompt's metadata (`"image"`, prompts.py), each distinct one encoded once."""
    default_path = os.path.join(ASSETS, "nano-edit")
    pretrained_by = "tasks.nano_edit_pretrain"  # (before: `nano_edit.py pretrain`, no such command)
    omni_pipeline_class = None  # (inherited, Qwen-Image's text-to-image pipeline: served, the source went unseen)
    omni_unserved = ("has no vLLM-Omni pipeline: Qwen-Image's never sees the source, Qwen-Image-Edit's shows its text "
                     "encoder the image, which this toy's does not read")

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float,
                     metadata: list[dict] | None = None, height: int = 0, width: int = 0) -> dict:
        """The instruction's conditioning plus `source` (B, S, C·4): each prompt's source image at the output size."""
        cond = super().conditioning(prompts, negative_prompt, cfg_scale)
        paths = [m.get("image") for m in metadata or [{}] * len(prompts)]
        if None in paths or not height or not width:
            raise ValueError("--model nano-edit edits a source image: every prompt needs one in its metadata "
                             '("image": a path; prompts.py reads it from a .jsonl), and the output height and width')
        distinct = list(dict.fromkeys(paths))
        encoded = torch.cat([self.encode_source(path, height, width) for path in distinct])
        cond["source"] = encoded[torch.tensor([distinct.index(p) for p in paths], device=self.device)]
        return cond

    @torch.no_grad()
    def encode_source(self, path: str, height: int, width: int) -> torch.Tensor:
        """One source image file -> its packed latents (1, S, C·4): resized to (height, width) and preprocessed by the
        pipeline's image processor, encoded alone, the posterior's mode normalised by the VAE's latents_mean and
        latents_std (QwenImageEditPlusPipeline._encode_vae_image), packed."""
        pipe, vae = self.pipe, self.pipe.vae
        image = pipe.image_processor.resize(source_images.read(path), height, width)
        pixels = pipe.image_processor.preprocess(image, height, width).to(self.device, vae.dtype)
        z = vae.encode(pixels[:, :, None]).latent_dist.mode()  # (1, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        z = ((z - mean) / std)[:, :, 0]
        return pipe._pack_latents(z, 1, z.shape[1], z.shape[2], z.shape[3]).to(self.dtype)

    def _forward(self, x, timestep, embeds, mask, img_shapes):
        """The transformer on [noisy, source] (B, 2S, C·4): each row's shapes list the source's after the output's."""
        return super()._forward(x, timestep, embeds, mask, [[*s, *s] for s in img_shapes])

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4): Qwen-Image's call (true CFG included) on [x, source], its output's first S tokens."""
        hidden = torch.cat([x.to(self.dtype), cond["source"]], dim=1)
        return super().velocity(hidden, sigma, cond, cfg_scale, height, width)[:, :x.shape[1]]

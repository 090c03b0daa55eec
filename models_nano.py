"""The laptop tasks' models (nano.py): Qwen-Image's classes at toy size with the tiny model's frozen text encoder,
tokenizer and scheduler, their VAE and transformer pretrained here and shipped in assets/ (diffusers' format,
float16). `--model nano` asks for one handwritten digit at 16×16."""
import os

import torch

from models_qwen import QwenImage, build_tiny_qwen_pipeline

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
NANO_DIR = os.path.join(ASSETS, "nano")  # `python nano.py pretrain` writes it


def build_nano_pipeline(path: str | None = NANO_DIR, vae=None, transformer=None):
    """The nano model (nano.py): the tiny pipeline's frozen text encoder, tokenizer and scheduler (seed 0, always: the
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
    """`nano`: Qwen-Image's classes at toy size, pretrained on real handwritten digits (nano.py, docs/algorithm.md
    §15); --model-path is a directory of its trained parts (default: the shipped assets/nano)."""
    default_path = NANO_DIR
    trained_classes = {"vae": "AutoencoderKLQwenImage", "transformer": "QwenImageTransformer2DModel"}  # what it loads
    pretrained_by = "nano.py"  # the script whose `pretrain` writes its directory

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, guidance: float | None = None) -> QwenImage:
        return cls(build_nano_pipeline(path or cls.default_path), device, torch.float32)


class NanoComposeQwenImage(NanoQwenImage):
    """`nano-compose`: GenEval's questions at 32×32 (nano_compose.py, docs/tasks.md): the same classes, a VAE 4× down
    to 8 channels and a transformer of 16 tokens, pretrained on rendered compositions; only 32×32, what its judge
    reads."""
    default_path = os.path.join(ASSETS, "nano-compose")
    pretrained_by = "nano_compose.py"
    side = 32

    @classmethod
    def check_size(cls, model: str, spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        if (height, width) != (cls.side, cls.side):
            raise ValueError(f"--model {model} draws {cls.side}×{cls.side} images (its canvas, which its judge and "
                             f"reward read): --height {cls.side} --width {cls.side}, got {height}×{width}")

"""A model directory's files, read within bounds before anything is built from them: a file is opened only if it is a
regular file of bounded size (a FIFO never blocks, a link to /dev/zero is refused), a config.json's repeated stacks are
bounded, a safetensors file's header is read alone and checked against the file's size, and a config is built
weightless (meta device) to compare its tensors with the weights'. model_checks.py checks `--model-path` with these at
start-up, and models_base.from_pretrained a pipeline directory's parts before diffusers loads them; each ValueError
says what is wrong, the caller names the file and the fix."""
import json
import os
import re
import stat

import torch

MAX_CONFIG_BYTES = 1 << 20  # a diffusers config.json holds a few KB; a larger file is not one and is never read
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on its JSON header
# Stacks a config repeats: beyond any published model (Qwen-Image 60 layers, VAEs 4 levels). A weightless copy of 256
# Qwen-Image blocks builds in ~1.5 s; 10⁶ would take hours, before the weights could say they hold 4.
MAX_REPEATS, MAX_LIST = 256, 64


def open_bounded(path: str, limit: int | None = None):
    """`path` opened for reading (binary) if it is a regular file (of at most `limit` bytes), checked on the descriptor
    before a byte is read: opened without blocking (a FIFO never waits for a writer), following links (a link to
    /dev/zero is then a character device, refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        raise ValueError("is missing" if missing else f"cannot be opened ({e.strerror})") from None
    info = os.fstat(fd)
    regular, too_big = stat.S_ISREG(info.st_mode), limit is not None and info.st_size > limit
    if not regular or too_big:
        os.close(fd)
        raise ValueError(f"holds {info.st_size} bytes, more than {limit}" if regular else
                         f"is not a regular file (mode {stat.filemode(info.st_mode)})")
    return open(fd, "rb")


def read_config(path: str) -> dict:
    """A diffusers config.json (or model_index.json) with a `_class_name`, its size bounded before it is read and the
    stacks it repeats (`num_*layers`, `num_*blocks`, Z-Image's `n_layers`, `n_refiner_layers`, lists) before anything
    is built from it."""
    with open_bounded(path, MAX_CONFIG_BYTES) as f:
        try:
            config = json.loads(f.read())
        except (ValueError, RecursionError) as e:  # not UTF-8 (a ValueError too), not JSON, nested too deep
            raise ValueError(f"is not JSON ({type(e).__name__})") from None
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        raise ValueError("has no `_class_name` (not a diffusers config)")
    for key, value in config.items():
        if isinstance(value, list) and len(value) > MAX_LIST:
            raise ValueError(f"has a {key} of {len(value)} entries, more than {MAX_LIST}")
        if re.fullmatch(r"(num|n)_\w*(layers|blocks)", key) and isinstance(value, int) and value > MAX_REPEATS:
            raise ValueError(f"has {key} {value}, more than {MAX_REPEATS}")
    return config


def weight_shapes(path: str) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors file's header (8 bytes of its length, then JSON; only these are read),
    the file checked to hold every byte the header places: a truncated file is named before anything reads tensors."""
    with open_bounded(path) as f:
        size = os.fstat(f.fileno()).st_size
        length = int.from_bytes(f.read(8), "little")
        header = f.read(length) if 8 + length <= min(size, 8 + MAX_HEADER_BYTES) else b""
    try:
        header = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        end = 8 + length + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
        shapes = {k: list(v["shape"]) for k, v in header.items()}
    except (ValueError, RecursionError, TypeError, KeyError, IndexError, AttributeError,
            OverflowError):  # not the header's layout (OverflowError: an offset of 1e999, JSON's float infinity)
        raise ValueError(f"is truncated or not safetensors ({size} bytes, no readable header)") from None
    if end > size:
        raise ValueError(f"is truncated: {size} bytes, where its header places {end}")
    return shapes


def check_pipeline_parts(path: str, given=()) -> None:
    """A local pipeline directory holds each part its model_index.json names (`given`: parts passed in instead): a
    folder per part, and each tokenizer's vocabulary (`tokenizer.json`, or every file its class's slow form reads).
    diffusers fails to load any other missing part, but transformers builds a tokenizer from no files without a word:
    FLUX.1's T5 read each prompt as <unk> and trained on it, Qwen-Image's crashed at its first prompt."""
    import transformers
    try:
        config = read_config(os.path.join(path, "model_index.json"))
    except ValueError as e:
        raise ValueError(f"its model_index.json {e}") from None
    missing = []
    for name, entry in config.items():
        if name.startswith("_") or name in given or not isinstance(entry, list) or len(entry) != 2 or not entry[0]:
            continue
        tokenizer = entry[0] == "transformers" and "Tokenizer" in str(entry[1])
        names = getattr(getattr(transformers, str(entry[1]), None), "vocab_files_names", None) if tokenizer else None
        vocabulary = [f for k, f in (names or {}).items() if k != "tokenizer_file"]
        files = [os.path.isfile(os.path.join(path, name, f)) for f in ["tokenizer.json", *vocabulary]]
        if not os.path.isdir(os.path.join(path, name)):
            missing.append(f"{name}/")
        elif vocabulary and not files[0] and not all(files[1:]):
            missing.append(f"{name}/tokenizer.json or {name}/{' + '.join(vocabulary)}")
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}, which its model_index.json names")


def build_weightless(config: dict) -> torch.nn.Module:
    """The model a config (read_config) describes, built on the meta device (no memory for weights); a ValueError if
    diffusers has no such model class or its constructor refuses a value."""
    import diffusers
    cls = getattr(diffusers, config["_class_name"], None)
    if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
        raise ValueError(f"names {config['_class_name']!r}, not a diffusers model class")
    try:
        with torch.device("meta"):
            return cls.from_config(config)
    except Exception as e:  # whatever its constructor refuses (a size of the wrong type or sign, heads that mismatch)
        reason = (str(e).strip().splitlines() or [""])[0][:160]
        raise ValueError(f"does not build a {cls.__name__} ({type(e).__name__}: {reason})") from None


def check_part(path: str, part: str, want: str) -> None:
    """A model part directory (`path`/`part`: config.json and diffusion_pytorch_model.safetensors) checked from its files
    before anything loads: both regular files, the config bounded and naming class `want`, the weights whole, and a
    weightless copy built from the config holding exactly the weights' tensors, in their shapes. A ValueError names
    the file and what is wrong with it."""
    file = f"{part}/config.json"
    try:
        config = read_config(os.path.join(path, file))
        if config["_class_name"] != want:
            raise ValueError(f"names {config['_class_name']}, not the {want} it must hold")
        built = {k: list(v.shape) for k, v in build_weightless(config).state_dict().items()}
        file = f"{part}/diffusion_pytorch_model.safetensors"
        weights = weight_shapes(os.path.join(path, file))
        differ = sorted(k for k in built.keys() | weights.keys() if built.get(k) != weights.get(k))
        if differ:
            raise ValueError(f"does not hold what {part}/config.json describes ({len(differ)} tensors differ, e.g. "
                             f"{differ[0]}: {weights.get(differ[0], 'absent')}, the config's "
                             f"{built.get(differ[0], 'absent')})")
    except ValueError as e:
        raise ValueError(f"{file} {e}") from None

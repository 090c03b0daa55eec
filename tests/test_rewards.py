"""Rewards in process: OCR with the real rapidocr models on images drawn here, the CLIP family on tiny
random-weight CLIP models built here (no downloads), weighted multi-reward, async scoring, bad input."""
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont
from rapidfuzz.distance import Levenshtein

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rewards  # noqa: E402
from tiny_setup import main_here  # noqa: E402


def draw(text, size=(320, 96)):
    """Black text on white; Pillow's built-in scalable font, so no system font is needed."""
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


def fake_reward(values):
    """A registry entry whose reward returns fixed values (to exercise the output checks)."""
    return lambda: (lambda images, prompts, metadata: values[: len(prompts)])


# ---------------------------------------------------------------- OCR

@pytest.fixture(scope="module")
def ocr():
    return rewards.make_reward("ocr")


def test_ocr_right_wrong_partial_text_and_formula(ocr):
    images = torch.stack([draw("HELLO WORLD"), draw("QUICK BROWN"), draw("HELLO")])
    prompts = ['a shop sign that says "Hello World"'] * 3
    scores, info = ocr(images, prompts, [{}] * 3)
    assert scores[0] > 0.95 and scores[1] < 0.2 and 0.3 < scores[2] < 0.7, scores
    np.testing.assert_array_equal(info["ocr"], scores)
    # The score is exactly the §8 formula applied to what the OCR model read.
    read = rewards.ocr_read(rewards.to_uint8(images))
    assert read[0].replace(" ", "").upper() == "HELLOWORLD"
    assert scores.tolist() == [rewards.ocr_score(t, "Hello World") for t in read]


def test_ocr_keeps_the_lines_paddleocr_keeps(ocr):
    """Flow-GRPO reads with PaddleOCR 2.9.1 (its README at 9745241), whose ocr() drops every line read with confidence
    under its drop_score, 0.5 (tools/infer/predict_system.py, TextSystem.__call__: `score >= self.drop_score` kept);
    Flow-GRPO's own `res[1][1] > 0` then drops nothing more. Random pen strokes in a line of "text" are read as low-
    confidence gibberish, which earned partial credit when every line was kept (0.30 for one such image)."""
    rng, eng = np.random.default_rng(0), rewards._ocr_engine()
    images = []
    for _ in range(12):
        im = Image.new("RGB", (512, 512), tuple(int(v) for v in rng.integers(150, 256, 3)))
        pen = ImageDraw.Draw(im)
        for k in range(int(rng.integers(6, 14))):
            x, ys = 30 + 34 * k, rng.integers(200, 260, 3)
            pen.line([(x, ys[0]), (x + int(rng.integers(5, 30)), ys[1]), (x + int(rng.integers(0, 30)), ys[2])],
                     fill="black", width=6)
        images.append(np.asarray(im))
    try:
        raw = [eng(Image.fromarray(a), text_score=0.0) for a in images]  # every line, with its confidence
    finally:
        eng.update_params(text_score=rewards.OCR_MIN_SCORE)
    lines = [list(zip(r.txts or (), r.scores or ())) for r in raw]
    public = ["".join(t if s > 0 else "" for t, s in ls if s >= 0.5) for ls in lines]
    assert any(s < 0.5 for ls in lines for _, s in ls), lines  # the case in question occurs
    assert rewards.ocr_read(np.stack(images)) == public, (lines, public)


def fg_video_ocr(readings: list[list[str]], prompts: list[str]) -> list[float]:
    """Flow-GRPO's video OCR reward re-typed (flow_grpo/ocr.py at 9745241, OcrScorer_video_or_image.__call__, lines
    89-124), given what the OCR read in each sampled frame (its frames 0, 4, 8, …)."""
    out = []
    for texts, prompt in zip(readings, prompts):
        target, kept = prompt.split('"')[1].replace(" ", "").lower(), []
        for text in texts:
            text = text.replace(" ", "").lower()
            score = 1 - min(Levenshtein.distance(text, target), len(target)) / len(target)
            if score > 0:
                kept.append(score)
        out.append(sum(kept) / len(kept) if kept else 0.0)
    return out


def test_video_ocr_is_flow_grpos(ocr, monkeypatch):
    """A video's OCR reward is Flow-GRPO's video formula, not the image one per frame: no containment rule (text
    beside the target costs: "OPEN NOW" scored 1 here, 0.25 there) and the mean over the frames scoring above 0 (one
    legible frame of three scored 1/3 here, 1 there)."""
    cases = [["OPEN NOW"] * 3, ["OPEN", "", ""], ["OPEN 24 HOURS", "open", "XYZ"], ["", "", ""], ["0PEN", "OPFN", "OP"]]
    rng = np.random.default_rng(0)
    cases += [["".join(rng.choice(list("OPEN XZ"), int(rng.integers(0, 8)))) for _ in range(3)] for _ in range(200)]
    readings = iter([t for c in cases for t in c])
    monkeypatch.setattr(rewards, "ocr_read", lambda frames: [next(readings) for _ in frames])
    videos = torch.zeros(len(cases), 9, 3, 8, 8)  # frames 0, 4, 8 read
    prompts = ['a neon sign that says "Open"'] * len(cases)
    scores, _ = ocr(videos, prompts, [{}] * len(cases))
    np.testing.assert_allclose(scores, fg_video_ocr(cases, prompts), rtol=0, atol=1e-12)
    assert scores[:3].tolist() == [0.25, 1.0, 1.0]


def test_ocr_score_formula():
    assert rewards.ocr_score("Big SALE: Hello World!", "hello world") == 1.0  # contained, spaces/case ignored
    assert rewards.ocr_score("helo", "hello") == pytest.approx(0.8)  # one edit out of five characters
    assert rewards.ocr_score("", "abc") == 0.0
    assert rewards.ocr_score("qqqqqqqqqqqqqqqqqqqq", "ab") == 0.0  # distance capped at the target's length


def test_ocr_target_rules():
    assert rewards.ocr_target('a baker\'s sign that says "OPEN" in "gold"') == "OPEN"  # first pair, not '
    assert rewards.ocr_target("a poster reading “Night Shift”") == "Night Shift"
    for prompt in ["a sign with no quoted text", 'an empty sign ""', "a baker's 'OPEN' sign"]:
        with pytest.raises(ValueError, match="no text between double quotes"):
            rewards.ocr_target(prompt)


def test_ocr_prompt_without_quotes_fails_before_ocr(ocr):
    with pytest.raises(ValueError, match="a sign that says open"):
        ocr(torch.stack([draw("OPEN")]), ["a sign that says open"], [{}])


def test_start_up_checks_build_no_models():
    # In a fresh interpreter: the checks must not import the OCR or CLIP libraries.
    code = (
        "import sys, rewards\n"
        "rewards.check_reward_spec('ocr=1.0,pickscore=0.5,clipscore,remote=http://127.0.0.1:1=0.1,"
        "judge:ocr=http://127.0.0.1:2')\n"
        "try:\n"
        "    rewards.check_prompts_for_reward('ocr=1,jpeg_compressibility=0.1', ['ok \"A\"', 'no quotes here'])\n"
        "except ValueError as e:\n"
        "    assert 'no quotes here' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
        "rewards.check_prompts_for_reward('jpeg_compressibility', ['no quotes is fine here'])\n"
        "heavy = [m for m in ('rapidocr', 'transformers', 'onnxruntime') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ---------------------------------------------------------------- spec parsing and output checks

@pytest.mark.parametrize("spec, message", [
    ("foo", "unknown reward 'foo'; valid: aesthetic, brightness, clipscore, compose, compose_bayes, compose_judge, "
             "compose_knn, digit, digit_bayes, digit_judge, digit_knn, edit, edit_judge, jpeg_compressibility"),
    ("ocr=1.0,bar=2", "unknown reward 'bar'"),
    ("ocr=heavy", "bad weight 'heavy'"),
    ("ocr=nan", "bad weight 'nan'"),
    ("brightness=1e999", "bad weight '1e999' in 'brightness=1e999'; write NAME=WEIGHT with a finite number"),
    ("ocr=", "bad weight ''"),
    ("ocr:somepath", "takes no argument"),
    ("", "empty reward"),
    ("ocr,,pickscore", "empty reward"),
    ("ocr,ocr=2", "appears twice"),
    ("remote", "bad server URL '' in 'remote' .*; write remote=http://HOST:PORT"),
    ("remote=127.0.0.1:8000", "bad server URL '127.0.0.1:8000'"),
    ("remote=http://host:port", "bad server URL 'http://host:port'"),
    ("remote=http://h:99999", r"bad server URL 'http://h:99999' in 'remote=http://h:99999' \(port 1-65535"),
    ("remote=http://h:0", "bad server URL 'http://h:0'"),
    ("remote=http://h", "bad server URL 'http://h'"),  # no port (it passed: the error itself asks for one)
    ("judge:ocr=http://a:1+http://a:", "bad server URL 'http://a:'"),
    ("remote=http://host:1/score?x=1", "bad server URL"),
    ("remote=http://user@host:1", "bad server URL"),
    ("remote=http://a:1+http://b:2", "remote takes one server"),
    ("remote=http://a:1=inf", "bad weight 'inf'"),
    ("remote=http://a:1,remote=http://a:1/", "'remote@a:1' appears twice"),
    ("judge=http://a:1", "judge needs a task, one of ocr, match"),
    ("judge:foo=http://a:1", "judge needs a task, one of ocr, match, edit, got 'judge:foo=http://a:1'"),
    ("judge:ocr", r"bad server URL '' in 'judge:ocr' .*; write judge:TASK=http://HOST:PORT\[\+http://HOST2:PORT"),
    ("judge:match=http://a:1+http://a:1", "bad server URL 'http://a:1'.*each server once"),
    ("judge:match=http://a:1+http://b:70000", "bad server URL 'http://b:70000'"),
    ("brightness=0", "every term has weight 0 .* nothing trains"),  # before: a run that trained nothing, silently
    ("ocr=0,brightness=0.0", "every term has weight 0"),
    # a directory that is not there: said at start-up, where it was said after the policy model was built
    ("pickscore:/nonexistent/PickScore_v1", "pickscore:/nonexistent/PickScore_v1: no such directory"),
    ("ocr=1,clipscore:./no-clip=0.5", "clipscore:./no-clip: no such directory"),
])
def test_bad_reward_specs(spec, message):
    with pytest.raises(ValueError, match=message):  # a regular expression
        rewards.check_reward_spec(spec)


def test_a_reward_model_that_cannot_be_loaded_stops_the_start_in_one_line(tmp_path):
    """Before: transformers' 61-line traceback."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^--reward pickscore: its model cannot be loaded \(.*\): check its name"):
        main_here("--reward", f"pickscore:{tmp_path / 'empty'}", "--run-dir", tmp_path / "run")


def test_url_rewards_parse_to_labels_and_weights():
    parsed = rewards._parse("ocr=1,judge:match=http://h1:8000+https://h2:8001/=0.5, remote=http://[::1]:9=2")
    assert [(label, weight) for label, _, _, _, weight in parsed] == [
        ("ocr", 1.0), ("judge:match@h1:8000+h2:8001", 0.5), ("remote@[::1]:9", 2.0)]
    assert parsed[1][3] == ("match", ["http://h1:8000", "https://h2:8001"]) and parsed[2][3] == ("http://[::1]:9",)
    # judge:ocr checks the prompts as ocr does (quoted text), judge:match does not.
    rewards.check_prompts_for_reward("judge:match=http://h:1", ["no quotes is fine here"])
    with pytest.raises(ValueError, match="'no quotes here' has no text between double quotes"):
        rewards.check_prompts_for_reward("judge:ocr=http://h:1", ['ok "A"', "no quotes here"])


def test_weighted_multi_reward_total_and_components():
    images, prompts = torch.rand(3, 3, 32, 32), ["a", "b", "c"]
    fn = rewards.make_reward("jpeg_compressibility=1.0, jpeg_incompressibility=0.25")
    total, info = fn(images, prompts, [{}] * 3)
    small, _ = rewards.make_reward("jpeg_compressibility")(images, prompts, [{}] * 3)
    assert set(info) == {"jpeg_compressibility", "jpeg_incompressibility"}
    np.testing.assert_array_equal(info["jpeg_compressibility"], small)  # components unweighted
    np.testing.assert_array_equal(info["jpeg_incompressibility"], -small)
    np.testing.assert_allclose(total, 1.0 * small + 0.25 * -small)
    assert total.dtype == np.float64 and total.shape == (3,)


def test_jpeg_reward_is_minus_kilobytes_and_sees_uint8_pixels():
    images = torch.rand(2, 3, 32, 32)
    fn = rewards.make_reward("jpeg_compressibility")
    scores, _ = fn(images, ["a", "b"], [{}, {}])
    quantised = (images * 255).round() / 255
    np.testing.assert_array_equal(fn(quantised, ["a", "b"], [{}, {}])[0], scores)
    assert (scores < 0).all() and (-scores > 1).all()  # noise does not compress: over 1 kB at 32x32


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_names_reward_and_prompt(monkeypatch, bad):
    monkeypatch.setitem(rewards.REWARDS, "broken", fake_reward([0.5, bad]))
    images, prompts = torch.rand(2, 3, 8, 8), ["a fine prompt", "the prompt that broke it"]
    for spec in ["broken", "jpeg_compressibility=1,broken=0.5"]:
        with pytest.raises(ValueError, match=r"reward 'broken' returned .* 'the prompt that broke it'"):
            rewards.make_reward(spec)(images, prompts, [{}, {}])


def test_bad_images_and_lengths():
    fn = rewards.make_reward("jpeg_compressibility")
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        fn(torch.rand(2, 32, 32, 3), ["a", "b"], [{}, {}])
    with pytest.raises(ValueError, match="NaN or infinity"):
        fn(torch.full((1, 3, 8, 8), float("nan")), ["a"], [{}])
    with pytest.raises(ValueError, match="2 images, 1 prompts"):
        fn(torch.rand(2, 3, 8, 8), ["a"], [{}])


# ---------------------------------------------------------------- async scoring

def test_async_rewards_keep_submission_order_and_time_the_wait():
    # Chunk i sleeps longer the earlier it was submitted, so with 3 workers they finish in reverse order.
    def slow(images, prompts, metadata):
        time.sleep(0.05 * (3 - int(images[0, 0, 0, 0])))
        return images[:, 0, 0, 0].double().numpy(), {"id": images[:, 0, 0, 0].double().numpy()}

    pool = rewards.AsyncRewards(slow, workers=3)
    for i in range(3):
        pool.submit(torch.full((2, 3, 4, 4), float(i)), ["p", "q"], [{}, {}])
    scores, info, waited = pool.collect()
    np.testing.assert_array_equal(scores, [0, 0, 1, 1, 2, 2])
    np.testing.assert_array_equal(info["id"], scores)
    assert 0.05 < waited < 5
    with pytest.raises(RuntimeError, match="nothing was submitted"):
        pool.collect()
    pool.close()


def test_async_rewards_copy_images_and_surface_errors(monkeypatch):
    monkeypatch.setitem(rewards.REWARDS, "broken", fake_reward([float("nan")]))
    pool = rewards.AsyncRewards(rewards.make_reward("jpeg_compressibility"))
    images = torch.rand(1, 3, 16, 16)
    expected, _ = rewards.make_reward("jpeg_compressibility")(images, ["a"], [{}])
    pool.submit(images, ["a"], [{}])
    images.zero_()  # the caller reuses its buffer: the submitted chunk must not change
    np.testing.assert_array_equal(pool.collect()[0], expected)
    pool.fn = rewards.make_reward("broken")
    pool.submit(images, ["the bad one"], [{}])
    with pytest.raises(ValueError, match="'the bad one'"):
        pool.collect()
    pool.close()


def test_async_rewards_raise_a_failed_chunk_without_waiting_for_a_hung_one():
    # Chunk 0 hangs (a server that never answers), chunk 1 fails: collect() raises chunk 1's error at once.
    release = threading.Event()

    def fn(images, prompts, metadata):
        if prompts[0] == "hung":
            release.wait(60)
            return np.zeros(1), {}
        raise ValueError("chunk 1 broke")
    pool = rewards.AsyncRewards(fn, workers=2)
    first = pool.submit(torch.rand(1, 3, 4, 4), ["hung"])
    pool.submit(torch.rand(1, 3, 4, 4), ["bad"])
    try:
        with pytest.raises(ValueError, match="chunk 1 broke"):
            pool.collect()
        assert first.running(), "collect() waited for the hung chunk"
    finally:
        release.set()
        pool.close()


# ---------------------------------------------------------------- CLIP family on tiny random models

@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A random-weight CLIPModel + CLIPProcessor saved to a directory, built entirely in code: no CLIP
    tokenizer files can be downloaded here, so the tokenizer is a byte-level BPE with no merges (every
    character a token), written by CLIPTokenizer from a vocabulary made here."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer
    chars = sorted(ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(chars + [c + "</w>" for c in chars])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    special = dict(bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
                   pad_token_id=vocab["<|endoftext|>"])
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=77, **special),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        projection_dim=16)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_clip")
    CLIPModel(config).save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    # A random LAION-style aesthetic head over the 16-d embedding, in both supported file formats.
    from safetensors.torch import save_file
    sizes = [(16, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)]
    head = {}
    for index, (n_in, n_out) in zip([0, 2, 4, 6, 7], sizes):
        head[f"layers.{index}.weight"] = torch.randn(n_out, n_in) / n_in ** 0.5
        head[f"layers.{index}.bias"] = torch.randn(n_out)
    torch.save(head, path / "head.pth")
    save_file(head, str(path / "head.safetensors"))
    return path


CLIP_PROMPTS = ['a cat holding a sign that says "hi"', "a dog", "an astronaut riding a horse on the moon",
                "x" * 300]  # the last one is longer than CLIP's 77 tokens: truncated, not an error


def test_clip_family_deterministic_and_batch_equals_singles(tiny_clip, monkeypatch):
    monkeypatch.setenv("FLOWGRPO_AESTHETIC_HEAD", str(tiny_clip / "head.pth"))
    torch.manual_seed(1)
    images = torch.rand(len(CLIP_PROMPTS), 3, 48, 40)
    meta = [{}] * len(CLIP_PROMPTS)
    for name in ["pickscore", "clipscore", "aesthetic"]:
        fn = rewards.make_reward(f"{name}:{tiny_clip}")
        batch, info = fn(images, CLIP_PROMPTS, meta)
        assert set(info) == {name} and batch.shape == (4,) and np.isfinite(batch).all()
        singles = np.concatenate([fn(images[i:i + 1], CLIP_PROMPTS[i:i + 1], meta[:1])[0] for i in range(4)])
        np.testing.assert_allclose(batch, singles, rtol=1e-5, atol=1e-6, err_msg=name)
        again = rewards.make_reward(f"{name}:{tiny_clip}")(images, CLIP_PROMPTS, meta)[0]
        np.testing.assert_array_equal(batch, again, err_msg=name)  # a rebuilt reward scores identically
        assert len(set(np.round(batch, 6))) > 1, name  # scores depend on the input


def test_clip_scores_follow_their_formulas(tiny_clip, monkeypatch):
    from transformers import CLIPModel, CLIPProcessor
    model, processor = CLIPModel.from_pretrained(tiny_clip).eval(), CLIPProcessor.from_pretrained(tiny_clip)
    images = torch.rand(2, 3, 32, 32)
    pil = [Image.fromarray(a) for a in rewards.to_uint8(images)]
    with torch.no_grad():
        out = model(**processor(text=CLIP_PROMPTS[:2], images=pil, padding="max_length", max_length=77,
                              truncation=True, return_tensors="pt"))
    logits = out.logits_per_image.diagonal().double().numpy()  # logit_scale * cos, transformers' own path
    pick = rewards.make_reward(f"pickscore:{tiny_clip}")(images, CLIP_PROMPTS[:2])[0]
    clip = rewards.make_reward(f"clipscore:{tiny_clip}")(images, CLIP_PROMPTS[:2])[0]
    np.testing.assert_allclose(pick, logits / 26, rtol=1e-5)
    np.testing.assert_allclose(clip, logits / 30, rtol=1e-5)
    # The aesthetic head loads the same from .pth and .safetensors.
    monkeypatch.setenv("FLOWGRPO_AESTHETIC_HEAD", str(tiny_clip / "head.pth"))
    a = rewards.make_reward(f"aesthetic:{tiny_clip}")(images, CLIP_PROMPTS[:2])[0]
    monkeypatch.setenv("FLOWGRPO_AESTHETIC_HEAD", str(tiny_clip / "head.safetensors"))
    np.testing.assert_array_equal(a, rewards.make_reward(f"aesthetic:{tiny_clip}")(images, CLIP_PROMPTS[:2])[0])


def test_a_clip_directory_written_with_a_tilde_loads_as_start_up_checked_it(tiny_clip, monkeypatch):
    """`pickscore:~/ckpt` (the shell leaves a "~" after ":" as it is): the start-up check expanded it and passed, then
    the reward, built after the policy model, handed "~/ckpt" to transformers as a hub id and stopped the run."""
    monkeypatch.setenv("HOME", str(tiny_clip.parent))
    images = torch.rand(2, 3, 32, 32)
    for name in ["pickscore", "clipscore"]:
        rewards.check_reward_spec(f"{name}:~/{tiny_clip.name}")
        got = rewards.make_reward(f"{name}:~/{tiny_clip.name}")(images, CLIP_PROMPTS[:2])[0]
        np.testing.assert_array_equal(got, rewards.make_reward(f"{name}:{tiny_clip}")(images, CLIP_PROMPTS[:2])[0])


def test_aesthetic_without_head_fails_at_check_time(monkeypatch, tmp_path):
    monkeypatch.delenv("FLOWGRPO_AESTHETIC_HEAD", raising=False)
    with pytest.raises(ValueError, match="FLOWGRPO_AESTHETIC_HEAD"):
        rewards.check_reward_spec("ocr=1,aesthetic=0.5")
    monkeypatch.setenv("FLOWGRPO_AESTHETIC_HEAD", str(tmp_path / "missing.pth"))
    with pytest.raises(ValueError, match="missing.pth"):
        rewards.check_reward_spec("aesthetic")


def test_thread_pool_scores_clip_concurrently(tiny_clip):
    # Two workers share one model: results must equal the serial ones.
    fn = rewards.make_reward(f"clipscore:{tiny_clip}")
    images = torch.rand(4, 3, 32, 32)
    serial = fn(images, CLIP_PROMPTS, None)[0]
    pool = rewards.AsyncRewards(fn, workers=2)
    for i in range(4):
        pool.submit(images[i:i + 1], CLIP_PROMPTS[i:i + 1])
    np.testing.assert_allclose(pool.collect()[0], serial, rtol=1e-5, atol=1e-6)
    pool.close()

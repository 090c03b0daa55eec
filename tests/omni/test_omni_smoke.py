"""Smoke test: the real vLLM-Omni 0.30.0 server (CPU platform plugin) serves the tiny Qwen-Image pipeline."""
import base64
import io
import time

from PIL import Image

SIZE = 64  # sides: multiples of 8 for the tiny pipeline (VAE ×4, 2×2 patches); VAE decode dominates above 64 on CPU


def generate(server, **fields) -> tuple[list[Image.Image], float, dict]:
    body = dict(prompt="a red cube on a table", size=f"{SIZE}x{SIZE}", num_inference_steps=3, seed=0, n=1)
    body.update(fields)
    t0 = time.monotonic()
    status, resp = server.request("POST", "/v1/images/generations", body, timeout=120)
    elapsed = time.monotonic() - t0
    assert status == 200, f"POST /v1/images/generations -> {status}: {resp}"
    images = [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))) for item in resp["data"]]
    return images, elapsed, resp


def test_serves_images(omni_server):
    print(f"\nvllm serve healthy after {omni_server.start_s:.1f} s: {' '.join(omni_server.argv)}")

    images, elapsed, resp = generate(omni_server)
    print(f"one {SIZE}x{SIZE} 3-step image in {elapsed * 1000:.0f} ms; response keys {sorted(resp)}")
    assert len(images) == 1 and images[0].size == (SIZE, SIZE)

    again, _, _ = generate(omni_server)
    assert again[0].tobytes() == images[0].tobytes(), "the same seed must reproduce the same image"
    other, _, _ = generate(omni_server, seed=1)
    assert other[0].tobytes() != images[0].tobytes(), "another seed must give another image"

    pair, elapsed, _ = generate(omni_server, n=2)
    print(f"n=2 in {elapsed * 1000:.0f} ms")
    assert len(pair) == 2 and pair[0].tobytes() != pair[1].tobytes()

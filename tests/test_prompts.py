"""Prompt sets (files and built-ins, train/eval splits) and the resumable prompt sampler."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import prompts  # noqa: E402
import rewards  # noqa: E402


def test_builtin_ocr_set():
    s = prompts.load_prompts("ocr")
    train, ev = [p for p, _ in s.train], [p for p, _ in s.eval]
    assert len(set(train)) == len(train) >= 500 and len(set(ev)) == len(ev) > 0
    assert not set(train) & set(ev)
    # Held out by phrase: no eval target text is ever trained on.
    assert not {rewards.ocr_target(p) for p in train} & {rewards.ocr_target(p) for p in ev}
    rewards.check_prompts_for_reward("ocr", train + ev)  # every prompt has quoted text
    assert all(m == {} for _, m in s.train + s.eval)


def test_builtin_general_set():
    s = prompts.load_prompts("general")
    train, ev = [p for p, _ in s.train], [p for p, _ in s.eval]
    assert 30 <= len(train) + len(ev) <= 60 and len(ev) >= 4
    assert len(set(train + ev)) == len(train + ev)  # distinct, and eval disjoint from train


def test_txt_file_small_and_large(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("a cat\n\n   \nA dog  \r\n")
    s = prompts.load_prompts(str(small))
    assert s.train == [("a cat", {}), ("A dog", {})] and s.eval == s.train  # too few to hold out
    small.write_bytes(b"\xef\xbb\xbfa cat\n")  # saved "UTF-8 with BOM": the mark was the first prompt's first letter
    assert prompts.load_prompts(str(small)).train == [("a cat", {})]
    big = tmp_path / "big.txt"
    big.write_text("\n".join(f"prompt {i}" for i in range(35)) + "\n")
    s = prompts.load_prompts(str(big))
    assert [p for p, _ in s.eval] == ["prompt 9", "prompt 19", "prompt 29"]  # every 10th held out
    assert len(s.train) == 32 and not {p for p, _ in s.train} & {p for p, _ in s.eval}
    # a file that repeats its prompts: every 10th distinct one held out with all its lines (every 10th line was, and
    # 4 of its 4 eval prompts were trained on); fewer than 10 distinct ones: all for both, as a small file
    big.write_text("\n".join(f"prompt {i % 30}" for i in range(60)) + "\n")
    s = prompts.load_prompts(str(big))
    assert [p for p, _ in s.eval] == ["prompt 9", "prompt 19", "prompt 29"] * 2 and len(s.train) == 54
    assert not {p for p, _ in s.train} & {p for p, _ in s.eval}
    big.write_text("\n".join(f"prompt {i % 5}" for i in range(40)) + "\n")
    s = prompts.load_prompts(str(big))
    assert s.eval == s.train and len(s.train) == 40


def test_jsonl_file_passes_metadata(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a sign \\"OPEN\\"", "text": "OPEN", "id": 3}\n\n{"prompt": "a cat"}\n')
    s = prompts.load_prompts(str(f))
    assert s.train == [('a sign "OPEN"', {"text": "OPEN", "id": 3}), ("a cat", {})]


def test_a_line_ends_at_a_newline_only(tmp_path):
    """A raw U+2028 inside a JSON string is legal JSON, and a form feed a character of a prompt: str.splitlines broke
    the line at both (the first read as "not valid JSON", the second as two prompts). Windows line ends still end."""
    f = tmp_path / "p.jsonl"
    f.write_bytes('{"prompt": "a sign \u2028OPEN"}\r\n{"prompt": "a cat"}\n'.encode())
    assert prompts.read_prompt_file(f) == [("a sign \u2028OPEN", {}), ("a cat", {})]
    (tmp_path / "p.txt").write_bytes(b"a cat\x0ca dog\r\na bird\n")
    assert prompts.read_prompt_file(tmp_path / "p.txt") == [("a cat\x0ca dog", {}), ("a bird", {})]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "ok"}', "", '{"prompt": "ok", }'], r"p\.jsonl:3: not valid JSON"),
    (['{"prompt": "ok"}', '{"text": "no prompt key"}'], r"p\.jsonl:2: .*non-empty string \"prompt\""),
    (['["a list"]'], r"p\.jsonl:1: "),
    (['{"prompt": ""}'], r"p\.jsonl:1: "),
    (['{"prompt": 7}'], r"p\.jsonl:1: "),
])
def test_malformed_jsonl_names_the_line(tmp_path, lines, message):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        prompts.load_prompts(str(f))


def test_missing_empty_and_unknown_prompt_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        prompts.load_prompts(str(tmp_path / "nope.txt"))
    for name, text in [("empty.txt", ""), ("blank.txt", "\n  \n"), ("empty.jsonl", "\n")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=f"{name} has no prompts"):
            prompts.load_prompts(str(tmp_path / name))
    with pytest.raises(ValueError, match=r"expected a \.txt or \.jsonl file or one of \['compose', 'digits', 'general', 'ocr'\]"):
        prompts.load_prompts("prompts.csv")
    (tmp_path / "dir.txt").mkdir()  # a directory with a file's name is not "missing"
    with pytest.raises(FileNotFoundError, match="dir.txt is a directory"):
        prompts.load_prompts(str(tmp_path / "dir.txt"))
    (tmp_path / "latin1.txt").write_bytes("a caf\u00e9 sign\n".encode() + "a caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:2: not UTF-8 text .* save the file as UTF-8"):
        prompts.load_prompts(str(tmp_path / "latin1.txt"))


def test_sampler_epochs_without_replacement_and_determinism():
    s = prompts.PromptSampler(10, seed=3)
    epoch = s.sample(0, 5) + s.sample(1, 5)
    assert sorted(epoch) == list(range(10))  # each prompt once per epoch
    assert sorted(s.sample(2, 5) + s.sample(3, 5)) == list(range(10))
    assert s.sample(2, 5) + s.sample(3, 5) != epoch  # a new permutation per epoch
    # k not dividing n: positions run on across epochs; 7 iterations of 3 cover 2 whole epochs + 1.
    picks = [i for it in range(7) for i in prompts.PromptSampler(10, 3).sample(it, 3)]
    assert sorted(picks[:20]) == sorted(list(range(10)) * 2)
    assert prompts.PromptSampler(10, 4).sample(0, 10) != prompts.PromptSampler(10, 3).sample(0, 10)
    assert prompts.PromptSampler(1000, 0).sample(5, 64) == prompts.PromptSampler(1000, 0).sample(5, 64)


def test_sampler_resume_needs_only_the_iteration():
    straight = prompts.PromptSampler(37, seed=11)
    expected = [straight.sample(i, 8) for i in range(12)]
    resumed = prompts.PromptSampler(37, seed=11)  # a resumed run's: its flags' (flowgrpo.main loads nothing into it)
    assert [resumed.sample(i, 8) for i in range(6, 12)] == expected[6:]
    with pytest.raises(ValueError, match="seed must be >= 0"):
        prompts.PromptSampler(5, seed=-1)
    with pytest.raises(ValueError, match="at least one prompt"):
        prompts.PromptSampler(0, seed=1)


def test_a_jsonl_may_say_which_prompts_are_held_out(tmp_path):
    lines = [{"prompt": f"a {d}", "tag": "single", "split": "eval" if d in (3, 7) else "train"} for d in range(10)]
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(map(json.dumps, lines)))
    s = prompts.load_prompts(str(path))
    assert [p for p, _ in s.eval] == ["a 3", "a 7"] and len(s.train) == 8
    assert s.eval[0][1] == {"tag": "single", "split": "eval"}  # the metadata travels with the prompt
    for last, found in (({"prompt": "a 9", "split": "test"}, "test"), ({"prompt": "a 9"}, "none")):  # the second:
        path.write_text("\n".join(map(json.dumps, lines[:9] + [last])))  # a KeyError's traceback before
        with pytest.raises(ValueError, match=f'every line needs "train" or "eval" .*found \\[.?{found}.?\\]'):
            prompts.load_prompts(str(path))


def test_a_lone_carriage_return_ends_a_line(tmp_path):
    """An old Mac editor ends lines with a lone "\\r": a .txt of three prompts was read as one prompt holding all three
    (a .jsonl as "not valid JSON"). A raw "\\r" is never part of a prompt, nor legal inside a JSON string."""
    (tmp_path / "p.txt").write_bytes(b"a cat\ra dog\ra bird\r")
    got = prompts.read_prompt_file(tmp_path / "p.txt")
    assert got == [("a cat", {}), ("a dog", {}), ("a bird", {})], f"{len(got)} prompts read, 3 written: {got}"
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "a cat"}\r{"prompt": "a dog"}\r')
    assert prompts.read_prompt_file(tmp_path / "p.jsonl") == [("a cat", {}), ("a dog", {})]


def test_a_byte_that_is_not_utf8_is_named_at_its_line_after_a_bom_or_lone_carriage_returns(tmp_path):
    """A file saved "UTF-8 with BOM" (or with an old Mac editor's lone "\\r" line ends) with one Latin-1 line: the error
    named the wrong line (2 or 1, not 3) and, after a mark, a byte 3 short of the bad one (offsets counted after the
    mark, lines at "\\n" only). Now the line as the reader numbers its prompts, and the byte in the file."""
    for name, raw in [("bom.txt", b"\xef\xbb\xbfa cat\na dog\n\xe9t\xe9\n"), ("mac.txt", b"a cat\ra dog\ra caf\xe9\r"),
                      ("both.jsonl", b'\xef\xbb\xbf{"prompt": "a"}\r\n{"prompt": "b"}\r{"prompt": "caf\xe9"}\n')]:
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ValueError, match=rf"{name}:3: not UTF-8 text \(.* at byte {raw.index(0xe9)}\)"):
            prompts.read_prompt_file(tmp_path / name)

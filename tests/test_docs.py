"""The front page and the manual hold together: every relative link of README.md and docs/*.md reaches a file of the
repository and every `#anchor` a heading (GitHub's slugs), the README stays a front page (≤ 150 lines), each page
opens with a sentence saying what it is for, CI runs the README's own set-up and test commands, what ran where is
said truly, and the test counts are the suite's."""
import dataclasses
import glob
import json
import math
import os
import re
import subprocess
import sys

import cli
import flowgrpo
import sequence_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_LINES = 150  # a front page read in two minutes; the rest is docs/
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def pages(root: str = ROOT) -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "docs", "*.md")))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text as rendered (no code ticks, emphasis or link targets), lowercase,
    every character but letters, digits, '_', '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("**", "").strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "_- ").replace(" ", "-")


def anchors(path: str) -> set[str]:
    """Every heading's slug in one .md file; a repeated slug gets -1, -2, … as on GitHub."""
    seen, out = {}, set()
    for line in FENCE.sub("", open(path, encoding="utf-8").read()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            s = slug(m.group(1))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


def tracked(root: str) -> set[str]:
    """The repository's files, committed or about to be (git's list; every file on disk in a copy without git)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True)
    files = listed.stdout.split()
    return set(files) or {os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root) for f in names}


def broken_links(root: str = ROOT) -> list[str]:
    """'file: target (why)' for each relative link that reaches no file of the repository or no heading there."""
    files, broken = tracked(root), []
    dirs = {os.path.dirname(f) for f in files} | {os.path.dirname(os.path.dirname(f)) for f in files}
    for page in pages(root):
        text = re.sub(r"`[^`]*`", "", FENCE.sub("", open(os.path.join(root, page), encoding="utf-8").read()))
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto: — not the repository's
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if dest.startswith("..") or (dest not in files and dest.rstrip("/") not in dirs):
                broken.append(f"{page}: {target} (no file {dest} in the repository)")
            elif anchor and not dest.endswith(".md"):
                broken.append(f"{page}: {target} (an anchor into {dest}, which has no headings)")
            elif anchor and anchor not in (found := anchors(os.path.join(root, dest))):
                near = sorted(a for a in found if a[:6] == anchor[:6]) or sorted(found)[:5]
                broken.append(f"{page}: {target} (no heading #{anchor} in {dest}; it has e.g. {near})")
    return broken


def test_slugs_follow_github():
    assert slug("§12 Forward-process algorithms") == "12-forward-process-algorithms"
    assert slug("A reward on another machine (`remote=URL`)") == "a-reward-on-another-machine-remoteurl"
    assert slug("The reward server under load and attack: `python bench.py soak` (2026-12-01)") == \
        "the-reward-server-under-load-and-attack-python-benchpy-soak-2026-12-01"
    assert slug("**Run directories**") == "run-directories"


def test_every_link_and_anchor_resolves():
    broken = broken_links()
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page_and_every_page_opens_with_a_sentence():
    n = sum(1 for _ in open(os.path.join(ROOT, "README.md"), encoding="utf-8"))
    assert n <= README_LINES, f"README.md has {n} lines, {n - README_LINES} over {README_LINES}: move detail to docs/"
    bad = []
    for page in pages():
        lines = open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
        assert lines[0].startswith("# "), f"{page} does not start with a '# ' title: {lines[0]!r}"
        body = "\n".join(lines[1:]).strip()
        first = body.split("\n\n")[0]  # the first paragraph after the title
        prose = first and not re.match(r"(#|\||```|    |[-*>] |!\[|\d+\. )", first)
        if not (prose and len(first.split()) >= 8 and re.search(r"[.:]( |\n|$)", first)):
            bad.append(f"{page}: {first[:80]!r}")
    assert not bad, "pages that do not open with a sentence saying what they are for:\n" + "\n".join(bad)


def test_ci_runs_the_readmes_set_up_and_test_commands():
    """`.ci/run` is the README's promise kept on a fresh machine: its set-up steps are the README's set-up line's and
    its test command is the README's test block, character for character."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = [b.strip("`").split("\n", 1)[1].strip() for b in FENCE.findall(readme) if b.startswith("```bash")]
    readme_steps = {s.split("#")[0].strip() for b in blocks for line in b.splitlines() for s in line.split("&&")}
    ci = [line.strip() for line in open(os.path.join(ROOT, ".ci", "run")) if line.strip()[:1] not in ("", "#")]
    tests = [line for line in ci if "pytest" in line]
    assert tests and tests[-1] in blocks, f"CI's test command {tests} is not a README block of its own: {blocks}"
    steps = [re.sub(r"^quiet_pip |\s-q\b", "", line) for line in ci if re.match(r"(quiet_pip pip|python3 -m venv|\. )",
                                                                             line)]
    assert steps and set(steps) <= readme_steps, f"CI set-up steps missing from the README: {set(steps) - readme_steps}"


def test_every_package_the_requirements_bring_is_pinned():
    """requirements.txt says every version is pinned: each package its packages need (transitively, as installed here,
    markers evaluated) is listed at the version installed. Before: cloudpickle (joblib's) and narwhals (scikit-learn's)
    came in unpinned."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    lines = [ln.split("#")[0].strip() for ln in open(os.path.join(ROOT, "requirements.txt"))]
    pinned = dict(ln.split("==") for ln in lines if ln)
    pinned = {canonicalize_name(k): v for k, v in pinned.items()}
    todo, seen, unpinned = list(pinned), set(), {}
    while todo:
        name = todo.pop()
        if name in seen or name in ("pip", "setuptools", "wheel"):  # the environment's own tools, as pip freeze has it
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional package of some pinned one that this environment does not have
        if pinned.get(name, "").split("+")[0] != dist.version.split("+")[0]:
            unpinned[name] = f"installed {dist.version}, pinned {pinned.get(name)}"
        for spec in map(Requirement, dist.requires or []):
            if spec.marker is None or spec.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(spec.name))
    assert not unpinned, unpinned


# Denials of a run that happened. Before: the front page said nano-compose's method comparison "is not run yet" under
# its figure, and "GPU: no figure yet" after the first GPU run (2026-12-04, one H200).
STALE = re.compile(r"not run yet|no figure yet|no GPU has run|prepared,? (?:but )?not run", re.I)


def test_what_ran_where_denies_nothing_that_ran():
    """No page says a thing has not run when it has, and the front page's "What ran where" names the method comparison
    of every laptop task whose comparison figure ships in assets/ (`python -m tasks.nano_compare` writes assets/<task>/compare.png)."""
    stale = [f"{page}: {m.group(0)!r}" for page in pages() for m in STALE.finditer(open(os.path.join(ROOT, page)).read())]
    assert not stale, stale
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    compared = next(s for s in re.split(r"(?<=;)|\n- ", readme.split("## What ran where", 1)[1]) if "comparison" in s)
    tasks = sorted(t for t in os.listdir(os.path.join(ROOT, "assets")) if os.path.isfile(
        os.path.join(ROOT, "assets", t, "compare.png")))
    assert tasks and all(re.search(rf"\b{t}\b", compared) for t in tasks), (tasks, compared)


# `python -c COUNTS`: the suite as pytest collects it: [tests, of them in tests/omni, of them needing a GPU (a skipif
# whose reason names one, whatever this machine has)]
COUNTS = """
import json, pytest
class Count:
    def pytest_collection_modifyitems(self, items):
        gpu = [i for i in items if any("GPU" in m.kwargs.get("reason", "") for m in i.iter_markers("skipif"))]
        self.counts = [len(items), sum(i.nodeid.startswith("tests/omni/") for i in items), len(gpu)]
count = Count()
pytest.main(["--collect-only", "-qq", "-n", "0", "-p", "no:cacheprovider"], plugins=[count])
print(json.dumps(count.counts))
"""


def test_the_test_counts_the_readme_and_the_manual_give_are_the_suites():
    """The README's and docs/running.md's counts: the tests, and what a set-up of the README's alone passes (the
    vLLM-Omni tier skipped without its environment, the CUDA tests without a GPU). Before: "685 passed", which
    counted the vLLM-Omni tests only CI's environment runs."""
    out = subprocess.run([sys.executable, "-c", COUNTS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    total, omni, gpu = json.loads(out.stdout.strip().splitlines()[-1])
    readme = " ".join(open(os.path.join(ROOT, "README.md"), encoding="utf-8").read().split())
    running = " ".join(open(os.path.join(ROOT, "docs", "running.md"), encoding="utf-8").read().split())
    said = f"{total} tests on two pytest-xdist workers (`pytest.ini`; `-n 0` runs one process). With the README's " \
           f"set-up alone, {total - omni - gpu} pass and {omni + gpu} are skipped: the {omni} vLLM-Omni tests"
    assert said in readme and f"the {gpu} CUDA tests" in readme, (total, omni, gpu)
    assert f"{total} tests:" in running and f"({omni} tests against real vLLM" in running and f"its {gpu} CUDA cases" \
        in running and f"{total - omni - gpu} pass and those {omni + gpu} are skipped" in running, (total, omni, gpu)


def test_no_merge_conflict_markers_are_left():
    """Every tracked text file free of git's conflict markers (a merge once left docs/running.md with both sides)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    marked = [f for f in files if f.endswith((".py", ".md", ".sh", ".txt", ".ini", ".toml", ".jsonl")) and re.search(
        r"^(<{7}|>{7}) |^={7}$", open(os.path.join(ROOT, f), encoding="utf-8", errors="replace").read(), re.M)]
    assert not marked, marked


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(/\S*)?$")  # RUN_DIR, DIR, N, OUT, RUN/lora: a value the reader fills in


def documented_commands(root: str = ROOT) -> list[tuple[str, list[str]]]:
    """(page, words) of every command README.md and docs/*.md show: fenced lines and `inline` spans that run
    `python`, `torchrun` or `bash run.sh`; environment assignments, `nice -n K`, comments, `[ ]` around optional parts
    and `…` dropped. The set-up and test commands are CI's (test_ci_runs_the_readmes_set_up_and_test_commands)."""
    found = []
    for page in pages(root):
        text = open(os.path.join(root, page), encoding="utf-8").read()
        fenced = [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()[1:-1]]
        for line in fenced + re.findall(r"`([^`\n]+)`", FENCE.sub("", text)):
            words = re.sub(r"[\[\]]|\.\.\.|…", " ", line.split(" #")[0]).split()
            while words and (re.match(r"^\w+=", words[0]) or words[0] == "nice"):
                words = words[3:] if words[0] == "nice" else words[1:]
            runs = words[:1] in (["python"], ["python3"], ["torchrun"]) and len(words) > 1
            if (runs or words[:2] == ["bash", "run.sh"]) and words[1:3] not in (["-m", "pytest"], ["-m", "venv"]):
                found.append((page, words))
    return found


def test_every_command_the_readme_and_the_manual_show_runs():
    """Each command the front page and the manual show still runs as written, checked as far as a CPU can without
    training: `python flowgrpo.py FLAGS` (or under torchrun) parses through the loop's own start-up (a flag that was
    renamed, a value no longer taken fails) and its batch splits over the launched ranks; `python -m MODULE [SUBCOMMAND] FLAGS` and `python rewards.py serve` answer
    `--help` with every flag shown; `bash run.sh NAME` names a recipe of run.sh."""
    commands = documented_commands()
    assert len(commands) > 20 and any(w[:3] == ["python", "-m", "tasks.nano"] for _, w in commands), commands
    recipes_of_run_sh = set(re.findall(r"^  ([\w.-]+)\)", open(os.path.join(ROOT, "run.sh")).read(), re.M))
    helps, failed = {}, []
    for page, words in commands:
        shown = " ".join(words)
        if words[0] == "bash":
            if len(words) > 2 and words[2] not in recipes_of_run_sh:
                failed.append(f"{page}: `{shown}`: run.sh has no recipe {words[2]!r}")
            continue
        script = next((i for i, w in enumerate(words) if w.endswith(".py") or w == "-m"), None)
        if script is None:
            continue  # `torchrun --nproc_per_node=N`: a launcher's flag shown alone, no command
        if words[script] == "flowgrpo.py" and "--help" not in words:
            argv = words[script + 1:]
            if any(PLACEHOLDER.match(w) for w in argv):  # --model M: the flags alone must exist
                names = [f.name.replace("_", "-") for f in dataclasses.fields(flowgrpo.Args)]
                known = {f"--{p}{n}" for n in names for p in ("", "no-")}
                failed += [f"{page}: `{shown}`: no flag {w}" for w in argv
                           if w.startswith("--") and w not in known]
                continue
            try:  # and its batch splits over the ranks the launcher starts, less those that only sample
                a = cli.parse_args(flowgrpo.Args, argv)
                ranks = math.prod(int(n) for n in re.findall(r"--(?:nproc_per_node|nnodes)[= ](\d+)", shown))
                if argv:  # not a launcher's form with its flags elided (`flowgrpo.py ...`)
                    flowgrpo.batch_arithmetic(a, sequence_parallel.data_parallel_size(ranks - a.rollout_ranks, a.sp))
            except (ValueError, SystemExit) as e:
                failed.append(f"{page}: `{shown}`: {e}")
            continue
        target = words[script:script + 2] if words[script] == "-m" else words[script:script + 1]
        rest = words[script + len(target):]
        sub = rest[:1] if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]) else []
        key = tuple(target + sub)
        if key not in helps:
            out = subprocess.run([sys.executable, *key, "--help"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=300)
            helps[key] = out.stdout if out.returncode == 0 else None
            if out.returncode:
                failed.append(f"{page}: `{shown}`: `python {' '.join(key)} --help` failed: {out.stderr[-300:]}")
        flags = [w.split("=")[0] for w in rest if w.startswith("--")]
        failed += [f"{page}: `{shown}`: {' '.join(key)} has no flag {f}" for f in flags
                   if helps[key] is not None and f not in helps[key]]
    assert not failed, f"{len(failed)} documented commands do not run as written:\n" + "\n".join(failed)

"""The repository's shape: each concept's file stays small enough to read in one sitting, and the repository stands
alone (every document it cites is inside it)."""
import ast
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The design's table: one concept per file, each file's budget in lines, a target that keeps it readable in one sitting.
# A budget is met by moving a concept into a file of its own or removing code, never by squeezing lines; one raised
# above the design's target says why beside it.
BUDGETS = {
    "flowgrpo.py": 450,  # the loop: batch arithmetic, the rollout phase (`draw`), evaluation, an iteration's phases
    # every flag of the loop, documented once, in a dataclass per phase (a section of --help each); 303 since 2026-12-08
    # for --adv-eps, the advantages' ε, with which the Flow-DPPO recipe divides as UniRL's does (1e-8, not 1e-4)
    "args.py": 303,
    "offpolicy.py": 200,  # an iteration's rollout phase now or one iteration ahead of the update; its checkpointed batch
    "rollout_ranks.py": 250,  # a local rollout on torchrun ranks of its own: the split world, weights out, images back
    # what a run checks before anything expensive starts: each refusal in one line; 155 since 2026-12-06 for the
    # recipe's values read once by both checks of flags given to no effect (another algorithm's, or without a companion);
    # 160 since 2026-12-07 for vLLM-Omni's request limits, which a run met at its first rollout, after the model loaded
    "startup.py": 160,
    # the command line read over a recipe's values, in Args' groups (a section of --help each), tyro's errors in one line
    "cli.py": 100,
    # the named configurations, each value with its source; raised from 200 for the 2026 families' recipes (nine:
    # Flow-Factory's four Z-Image and FLUX.2 [klein] configs, Qwen-Image 2.1's two, three toys); 226 since 2026-12-08:
    # the Flow-DPPO recipe's advantages as UniRL's (n − 1 std + 1e-8, unclipped), said beside it
    "recipes.py": 226,
    # the --algorithm table, what its rows share, and Flow-GRPO's loss with its variants' tables; 465 since 2026-12-06:
    # the decoupled correction's means, its metrics over all ranks, GARDO's refusal of a kept rollout forward (the next
    # growth splits Flow-GRPO's loss into a file of its own); 468 since 2026-12-08 for --adv-eps (its range, and the ε
    # passed to group_advantages), which the Flow-DPPO recipe needs to compute UniRL's advantages
    "algorithms.py": 468,
    "algorithms_forward.py": 450,  # the forward-process family: DiffusionNFT, AWM, their update and old policy
    "algorithms_preference.py": 450,  # the preference family: DGPO and online DPO, on the forward-process update
    # against reward hacking: NormGuard's velocity-norm hinge, GARDO's gate, advantages, state; raised from 200 for
    # the state a checkpoint keeps, checked value by value as it is read back, and to 220 for NormGuard's reference
    # pass shared with a loss's own at the same inputs (DGPO's KL: 128 of 512 training passes an iteration on nano)
    "regularisers.py": 220,
    "scheduler.py": 350,  # the sampling step with log-prob, sigma schedules, ODE solvers, windows
    "models.py": 250,  # the registry of --model names (a row per name, 23 with the 2026 families), loading, save-tiny
    # the start-up checks of the model flags, from the registry, the files and a weightless transformer: each refusal
    # in one line
    "model_checks.py": 200,
    "models_base.py": 250,  # what every adapter shares
    "model_files.py": 150,  # a model directory's files read within bounds before anything is built from them
    "models_qwen.py": 200, "models_sd3.py": 200, "models_flux.py": 200, "models_wan.py": 200,  # one family each
    "models_kontext.py": 200,  # the first edit family: FLUX.1 Kontext, a source image per prompt
    "models_qwen_edit.py": 200,  # the second edit family: Qwen-Image-Edit, the source through the VL encoder and VAE
    "models_zimage.py": 200, "models_flux2.py": 200,  # Z-Image; FLUX.2 [klein]
    # Qwen-Image 2.1: text to image and editing in one adapter; raised from 200 for --prefix-kv-cache (the rollout's
    # cache per chunk and CFG branch, filled or read by each call without autograd), then to 220 for a call per prompt
    # length (an image independent of its micro-batch's other prompts) and its pipeline's σ table under static configs
    "models_qwen21.py": 220,
    "models_nano.py": 200,  # the laptop tasks' models: Qwen-Image's classes pretrained here (nano-edit's edit call too)
    # --micro-batch 0: the micro-batch sized to the device's memory, measured; raised from 100 when it learnt to leave
    # room for what --reuse-rollout-forward keeps from the rollout to the update (84.5 against 61.4 GiB on an H200), to
    # 130 (2026-12-07) for every figure agreed over the ranks (a measurement runs FSDP2's collectives on each), to 140
    # (2026-12-07) for a measurement that runs out of memory, a size that does not fit rather than the run's end, to 150
    # (2026-12-07) for AdamW's moments, allocated at the first step after the measurement: off the budget first
    "memory.py": 150,
    "engine.py": 450,  # all distribution: FSDP2, LoRA, offload, the rollout's gathered weights, process groups
    "ema.py": 150,  # the shadows of the trained weights: the EMA and the old policy, sharded as the weights
    "precision.py": 100,  # bf16 compute without FSDP2 on a world of one: working copies, input casts
    "merged_lora.py": 100,  # --merged-lora: each LoRA layer through one bf16 weight, base and adapter summed
    "fp8_rollout.py": 100,  # --fp8-rollout: the rollout's frozen linear layers multiply in float8
    "sequence_parallel.py": 100,  # Ulysses through diffusers' context parallelism
    # the checkpoint format and its checks: meta.json, its manifest, resume; 255 since 2026-12-06: a run directory
    # given to --resume named as one, with the two commands that resume it
    "checkpoint.py": 257,  # 257 since 2026-12-08: a --resume that names no checkpoint lists those beside it
    "atomic_files.py": 100,  # files written atomically (a temporary name, renamed) and read back without a link
    "rollout.py": 450,  # trajectories with log-probs: the data contract, the trainer's own sampler (the local backend)
    # who samples, chosen by --rollout: the trainer's own model, or vLLM-Omni servers through their HTTP client
    "rollout_backends.py": 350,
    "omni/pipeline.py": 450,  # the pipelines that run inside vLLM-Omni servers
    "omni/pipeline_edit.py": 450,  # the edit families' pipelines inside vLLM-Omni servers: a source per request
    # the 2026 families' pipelines inside vLLM-Omni servers (Z-Image, FLUX.2 [klein]): each parent's preparation and
    # decode around the shared loop, with their 0.30.0 fixes; 160 lines for two, 200 leaves room for one more family
    "omni/pipeline_2026.py": 200,
    "omni/__init__.py": 10, "tasks/__init__.py": 10, "bench/__init__.py": 10,  # what each folder holds, and how to run it
    "omni/serve_tiny.py": 150,  # a tiny random-weight pipeline written to a directory and served by vLLM-Omni (tests)
    "omni/tiny_vl.py": 150,  # a tiny vision-language judge served by vLLM for the tests
    "rewards.py": 500,  # rewards by name, weighted sums, async scoring, the remote reward, the judge's registration
    "reward_judge.py": 250,  # the vision-language judge: its tasks, their scores, its client; an edit's source image
    "reward_http.py": 420,  # HTTP transport: a client with a deadline, retries and bounded replies
    "reward_server.py": 420,  # the bounded reward server
    "prompts.py": 200,  # prompt sets (built-in, .txt, .jsonl with its own held-out split) and the seeded sampler
    # an edit prompt's source image read within bounds wherever it is read (a prompt line's: its ratio the run's); its
    # content's hash
    "source_images.py": 150,
    "runlog.py": 300,  # what a run leaves for people: metrics, curves, grids, the closing summary
    # a run directory belongs to one run: claimed, locked, refused to another, resumed; raised from 200 for what a run
    # stopped by Ctrl-C or SIGTERM keeps there and says (the last trained iteration checkpointed on the way out), to
    # 250 (2026-12-07) for refusing a run directory inside another run's and a copied checkpoint's guessed one, to 260
    # (2026-12-07) for the whole command that continues a run (its --model and flags; `--resume auto` alone took tiny),
    # to 280 (2026-12-08) for a stopped run's LoRA export and what counts as finished now that a stopped run has lora/
    "rundir.py": 280,
    "tasks/nano.py": 450,  # the digits task and what the laptop tasks share (data, held-out sampling, CLI checks)
    # the steps every laptop task's base is trained with: the VAE, rectified flow for the transformer, the parts written
    "tasks/pretraining.py": 200,
    "tasks/nano_compose.py": 450,  # the GenEval-shaped task: a program judge, a differently built reward, evaluation
    "tasks/nano_compose_render.py": 250,  # nano-compose's prompt grammar, its prompt sets and the renders of any prompt
    # the GenEval-shaped task's base, pretrained in gated stages (the VAE, its decoder alone, the transformer)
    "tasks/nano_compose_pretrain.py": 200,
    "tasks/nano_edit.py": 450,  # the edit task on the digits: instructions with exact targets, judge, reward, evaluation, grid
    "tasks/nano_edit_pretrain.py": 200,  # the edit task's base: nano's VAE and a transformer trained here on exact edits
    # every RL method on a laptop task: runs, the judge at equal compute, table, curves; raised from 450 (2026-12-07)
    # for the base's digest, so that a comparison never reuses runs made on a base since re-pretrained in place
    "tasks/nano_compare.py": 475,
    "bench/overhead.py": 400,  # overhead ratios against diffusers and the bare model, on CPU
    # the host's work per transformer call, loop against bare diffusers, at real depth (CPU); the bytes a rollout gathers;
    # 250 since 2026-12-06: a rank of 2's and an --sp 2 rank's work per update call (what the split path adds)
    "bench/host.py": 250,
    "bench/overlap.py": 250,  # --off-policy 1's speed against a server, and the learning it keeps on nano
    "bench/plain.py": 100,  # the loop's update as the plainest PyTorch: the yardstick of framework overhead
    # images/s, MFU and peak memory at real width; the --sp rows; raised from 400 for their side chosen by the memory of
    # the GPU at hand (1024² on an H200, 768² where an 80-GB GPU could not hold the --sp 1 side at 1024²), and to 430
    # for --compile's rows end to end (the lever the H100's check of 2026-12-06 found), each row's first-update gap,
    # and a forward's profile (--fp8-rollout's forward, slower in eager there for a cause no profile has shown yet)
    "bench/gpu.py": 430,
    # the 2026 families' real architectures with random weights for bench/gpu.py (their transformers' and VAEs'
    # configs, random text states at the real width) and the FLOPs of a call as torch counts them
    "bench/families.py": 120,
    "bench/check.py": 200,  # the GPU tier in one command: every GPU step bounded, logged and summarised as it ends
    "bench/soak.py": 400,  # the reward server under load and attack
}


FOLDERS = ("", "tasks", "bench", "omni")  # the core at the root; beside it, what was built with it


def python_files() -> list[str]:
    return [os.path.join(d, f) for d in FOLDERS for f in sorted(os.listdir(os.path.join(ROOT, d))) if f.endswith(".py")]


def test_every_file_is_within_its_budget():
    counts = {f: sum(1 for _ in open(os.path.join(ROOT, f))) for f in BUDGETS if os.path.exists(os.path.join(ROOT, f))}
    print("\n" + "\n".join(f"{f:26s} {n:4d} / {BUDGETS[f]}" for f, n in counts.items()))
    unlisted = set(python_files()) - BUDGETS.keys()
    assert not unlisted, f"files missing from the table: {unlisted} (a new file says its concept and budget here)"
    over = {f: f"{n} > {BUDGETS[f]}" for f, n in counts.items() if n > BUDGETS[f]}
    assert not over, over


def tracked_files() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:  # a copy of the tree without git: every file but caches
        files = [os.path.relpath(os.path.join(d, f), ROOT) for d, dirs, names in os.walk(ROOT) for f in names
                 if not any(part.startswith(".") or part == "__pycache__" for part in os.path.relpath(d, ROOT).split(os.sep))]
    return files


def tracked_text_files() -> list[str]:
    return [f for f in tracked_files() if f.endswith((".py", ".md", ".sh", ".txt", ".toml", ".ini", "run"))]


# A lent GPU machine is sent the working tree and `.whl` (`bash run.sh gpu-wheels`: the packages its image lacks),
# 64 MiB at most together. The archive measured 38.0 MiB on 2026-12-05 (pip's pinned versions); 40 leaves room for it.
SENT_MIB, WHEELS_MIB = 64, 40


def test_a_gpu_machine_can_be_sent_the_tree_and_its_wheels():
    """The GPU check (bench/check.py) needs the tree and the wheels on a machine that reaches no package index; what
    grows here is the shipped weights and figures, so the tree keeps within what the wheels leave of the 64 MiB."""
    sizes = {f: os.path.getsize(os.path.join(ROOT, f)) for f in tracked_files() if os.path.isfile(os.path.join(ROOT, f))}
    largest = ", ".join(f"{f} {n / 2**20:.1f}" for f, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
    total = sum(sizes.values()) / 2**20
    assert total <= SENT_MIB - WHEELS_MIB, f"the tree is {total:.1f} MiB, over {SENT_MIB - WHEELS_MIB} (largest: {largest})"


def test_the_repository_refers_to_nothing_outside_itself():
    """Every document a file names (`*.md`) is a file of the repository, every relative path climbing out of a
    directory (`../x`) stays inside it, and every `docs/algorithm.md §N` cited exists."""
    files = tracked_text_files()
    names = {os.path.basename(f) for f in files}
    sections = set(re.findall(r"^## §(\d+)", open(os.path.join(ROOT, "docs", "algorithm.md")).read(), re.M))
    outside, dangling = [], []
    for f in files:
        text = open(os.path.join(ROOT, f), errors="replace").read()
        for n, line in enumerate(text.splitlines(), 1):
            written = "--markdown" in line or "tmp_path" in line  # a file a command or a test writes, not a citation
            # (OUT/x.md: a file bench/check.py writes into the folder its command line names)
            documents = [d for d in re.findall(r"(?<!OUT/)(?<![\w.-])([\w.-]+\.md)\b", line)
                         if d not in names and not written]
            climbs = [p for p in re.findall(r"(?<![\w.])((?:\.\./)+\w[\w.-]*)", line)
                      if not os.path.realpath(os.path.join(ROOT, os.path.dirname(f), p)).startswith(ROOT + os.sep)]
            outside += [f"{f}:{n}: {ref}" for ref in documents + climbs]
            dangling += [f"{f}:{n}: §{s}" for s in re.findall(r"docs/algorithm\.md §(\d+)", line) if s not in sections]
    assert not outside, "references to files outside the repository:\n" + "\n".join(outside)
    assert not dangling, f"sections missing from docs/algorithm.md (it has §{sorted(sections, key=int)}):\n" + \
        "\n".join(dangling)


def imported_names(node: ast.AST) -> set[str]:
    """The module names one node of a file's syntax tree may import: `import x.y`, `from x import y` (x, and x.y if y is
    a module), and the dynamic forms, `importlib.import_module("x")` / `__import__("x")` with a literal name and a
    "x:Name" string (a table of such strings resolved by import_module is an import all the same)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
            return {node.args[0].value}
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[\w.]+:\w+", node.value):
        return {node.value.split(":")[0]}
    return set()


def import_graph() -> dict[str, set[str]]:
    """{module: the project's modules it imports}, over the root's files and the folders beside them (`tasks.nano`)."""
    modules = {f[:-3].replace(os.sep, "."): f for f in python_files()}
    graph = {}
    for m, f in modules.items():
        names = set().union(*map(imported_names, ast.walk(ast.parse(open(os.path.join(ROOT, f)).read()))))
        graph[m] = names & modules.keys() - {m, m.rpartition(".")[0]}  # (a folder's __init__ is no module of ours)
    return graph


def test_imports_run_one_way():
    """No import circle between the project's files, counting imports inside functions (a lazy import of another
    project file to dodge a circle is one too) and dynamic imports by name. Before: rewards.py -> reward_http.py ->
    rewards.py; models.py -> models_flux.py -> models.py (models.py resolved "models_flux:Flux" by import_module)."""
    graph = import_graph()
    probe = ast.parse('importlib.import_module("a.b")\n__import__("c")\nTABLE = {"x": "d:Cls", "y": "no import"}\n'
                      'from tasks import nano')
    assert set().union(*map(imported_names, ast.walk(probe))) == {"a.b", "c", "d", "tasks", "tasks.nano"}
    assert {"tasks.nano", "models_nano"} <= graph["tasks.nano_compose"]  # the folders' imports are seen

    def reaches(start, goal, seen=()):  # a path start -> ... -> goal, as a list
        for d in sorted(graph[start]):
            if d == goal:
                return [start, d]
            if d not in seen and (path := reaches(d, goal, (*seen, d))):
                return [start, *path]
    circles = [" -> ".join(reaches(m, m)) for m in sorted(graph) if reaches(m, m)]
    assert not circles, circles


def test_the_core_stands_below_what_uses_it():
    """The root's files (the core) import nothing from bench/ or omni/ (vLLM-Omni's servers import the pipelines; the
    trainer never does), and from tasks/ only the registry of rewards by name (rewards.py: each laptop task's reward
    and judge, as models.py registers the tasks' model family); tasks/ imports nothing from bench/."""
    graph = import_graph()
    upward = [f"{m} -> {d}" for m, ds in sorted(graph.items()) for d in sorted(ds)
              if ("." not in m and d.startswith(("bench.", "omni.")))
              or ("." not in m and d.startswith("tasks.") and m != "rewards")
              or (m.startswith("tasks.") and d.startswith("bench."))]
    assert not upward, upward

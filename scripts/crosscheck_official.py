#!/usr/bin/env python
"""Cross-check our EAGLE-3 engine against the official SafeAILab/EAGLE code, round by round.

Both decode the same chat prompts greedily, with the same target weights, the same head and the
same tree, and the script compares, per prompt, the tokens each verification round accepted and
the output tokens; it prints a table and writes JSON (--out).

  # 1. a transformers copy of the embedded default target (SmolLM2-135M-Instruct, dequantised
  #    from its GGUF exactly as eagle3_jax loads it; ~650 MB, fp32, ~10 s once converted):
  .venv/bin/python scripts/crosscheck_official.py --write-target-hf /tmp/smollm2-hf
  # 2. the official code, unmodified (not a package: only put on sys.path):
  git clone https://github.com/SafeAILab/EAGLE /tmp/EAGLE
  # 3. the comparison (default: the shipped head, EAGLE's default tree, 3 built-in prompts):
  .venv/bin/python scripts/crosscheck_official.py --eagle-repo /tmp/EAGLE \\
      --target-hf /tmp/smollm2-hf --max-new-tokens 128 --out /tmp/crosscheck.json
  # a head whose config.json names target_hidden_size (see below): as is, then fixed on a copy
  ... --head HEAD_DIR
  ... --head HEAD_DIR --fix-config-copy
The three prompts at 96-128 new tokens take ~2-3 minutes on a 2-core CPU (both sides, ours
compiling its round once).

What is compared. Our side: `eagle3_jax.decoding.generate.stream_ids` (the engine's own round
step; it yields the prefill's token, then each round's emitted tokens: the accepted drafts and the
bonus), float32, the head with all its draft ids (`load_head(..., "full")`: decode.py would cut the
shipped head to 8,192 ids on a CPU; the official code knows no cut), and every tree node verified
(verify threshold 0; the official code has no adaptive verification). Official side:
`EaModel.from_pretrained(use_eagle3=True, ...)` and `EaModel.ea_generate` (eagenerate's loop,
yielding input_ids after each round; a round appends its root and accepted drafts, so the
accepted count is the growth minus one), temperature 0, float32. Trees: our --top-k K --depth D
--total-tokens N is the official top_k=K, depth=D-1, total_token=N (EAGLE counts the expansion
steps after the first level; both take the global top N-1 of the same candidate pool, root
included in N); the default, K 10 / D 8 / N 60, is EAGLE's own default (top_k 10, depth 7,
total_token 60). The official Llama code always feeds the draft the inputs of target layers 2,
L//2 and L-3 (outputs of 1, L//2-1, L-4: [1, 14, 26] for SmolLM2's 30); a head with other
`eagle_aux_hidden_state_layer_ids` is reported, since the official side would ignore them.

Reported per prompt (table, and in full in the JSON): rounds and tau (tokens per round, the bonus
included and the prefill's token not, as decode.py reports it) of each side over the same tokens
(our output: up to --max-new-tokens or EOS; the official loop runs on to more than that, so its
figures count only the rounds that reach our length), whether the output tokens are identical, and
the first round whose accepted count differs (our last round is cut at the token limit or EOS: it
only has to be no longer than the official one).

The head's config and the official loader. `cnets.Model` copies the target's
`model.embed_tokens.weight` into the draft only when the head's config.json has NO
`target_hidden_size` key; with the key it expects the head's own `embed_tokens.weight` and, when
the file has none, keeps nn.Embedding's random init silently (load_state_dict(strict=False)).
Heads exported by eagle3_jax before the fix (now in checkpoints/head_config.py) named the key
(= hidden_size) without an embedding. The script checks the head first and prints a WARNING line
in that case; --fix-config-copy runs the official side on a copy of the head (a temp directory,
weights symlinked) without the key. Our side always uses the head as given (it reads no meaning
into the key). The official loader finds the target's embedding through
model.safetensors.index.json, which --write-target-hf writes (a single-file checkpoint without one
is refused before anything runs).

Shims (applied at run time in the official worker process, never to the checkout; for
transformers 5.x, which the official code predates, each only when needed):
  1. eagle/model/modeling_{qwen2,qwen3,mixtral}_kv.py import names transformers 5 removed
     (modeling_attn_mask_utils, utils.LossKwargs); ea_model imports them at module level but a
     Llama target never uses them: a module that fails to import is replaced in sys.modules by a
     stub holding a placeholder class of the imported name.
  2. modeling_llama_kv.LlamaForCausalLM._tied_weights_keys is a list; transformers 5's post_init
     wants {tied name: source name}: set to {"lm_head.weight": "model.embed_tokens.weight"} when
     it is a list (it names the same tie).
  3. RoPE config: transformers 5 folds rope_theta into `rope_parameters` and returns that dict as
     `config.rope_scaling` even for plain RoPE, so the official `_init_rope` (target and draft)
     takes the scaled branch and fails (KeyError 'type' / no 'default' in ROPE_INIT_FUNCTIONS).
     The configs are given their transformers-4 form: rope_scaling None and rope_theta set for
     plain RoPE, {"type", "factor"} for linear/dynamic (the target's LlamaConfig is passed to
     from_pretrained as `config=`; EConfig.from_pretrained is wrapped to do the same).
  4. transformers 5 builds the model on the meta device and restores only the buffers it knows:
     the official non-persistent rotary buffers (inv_freq, cos_cached, sin_cached) came back as
     uninitialised memory (the target itself then answered garbage, slowly: denormal numbers).
     After loading, each target attention's own `_init_rope()` is run again (always: the
     constructor's own computation, a no-op where the loader kept the buffers; the worker logs
     how many it changed).
  Checked after loading: every target buffer finite, lm_head equal to the embedding for a tied
  target, and, unless the head names target_hidden_size, the draft's embedding equal to the
  target's.
With transformers 4.x shims 1-3 check and stand aside (not run here: the official code ran
with transformers 5.24 and these shims). --official-python PATH runs the official side with
another interpreter, e.g. a venv with what the checkout's setup.py pins (python -m venv
/tmp/venv-eagle; /tmp/venv-eagle/bin/pip install torch --index-url
https://download.pytorch.org/whl/cpu; /tmp/venv-eagle/bin/pip install transformers==4.46.2
safetensors accelerate);
the worker needs only torch, transformers and safetensors, never jax or eagle3_jax. By default it
is this interpreter, in a subprocess all the same (torch and jax apart; --official-threads, default
1: on a 2-core machine beside another job two torch threads ran ~10x slower than one).

Not compared: speed (both run on the CPU, the official code's tree bookkeeping in Python),
sampling (temperature 0 only), batches (the official code decodes one row).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from eagle3_jax.decoding.tree import TreeConfig

REPO = Path(__file__).resolve().parent.parent
DEFAULT_HEAD = REPO / "eagle3_jax" / "heads" / "smollm2_135m_instruct"
EMBED_KEY = "embed_tokens.weight"
PROMPTS = [
    ("explain", "What is speculative decoding? Answer in three sentences."),
    (
        "code",
        "Write a Python function that checks whether a string is a palindrome, ignoring case "
        "and punctuation, with a docstring and two examples.",
    ),
    ("list", "List three uses of a paperclip."),
]

# ---------------------------------------------------------------------------------------------
# The head's config as the official loader reads it (stdlib only: also used by the tests)
# ---------------------------------------------------------------------------------------------


def safetensors_keys(path: str | os.PathLike) -> set[str]:
    """Tensor names in one safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return set(header)


def official_embedding_issue(head: str | os.PathLike) -> str | None:
    """Why the official `cnets.Model` would draft from a randomly initialised embedding with this
    head, or None. It copies the target's `model.embed_tokens.weight` into the draft only when the
    head's config.json has no `target_hidden_size` key; with the key it expects the head's own
    `embed_tokens.weight` in model.safetensors, and, finding none, keeps nn.Embedding's random
    init without a word (load_state_dict(strict=False))."""
    head = Path(head)
    cfg = json.loads((head / "config.json").read_text())
    if "target_hidden_size" not in cfg:
        return None
    files = sorted(head.glob("*.safetensors"))
    if any(EMBED_KEY in safetensors_keys(f) for f in files):
        return None
    ths, hs = cfg["target_hidden_size"], cfg.get("hidden_size")
    if ths == hs:
        return (
            f"{head / 'config.json'} names target_hidden_size ({ths}, = hidden_size) and its "
            f"safetensors hold no {EMBED_KEY}: the official code (cnets.Model) then skips the "
            "target's embedding and drafts from a RANDOM one; --fix-config-copy runs it on a "
            "copy of the head without that key"
        )
    return (
        f"{head / 'config.json'} names target_hidden_size {ths} != hidden_size {hs} and its "
        f"safetensors hold no {EMBED_KEY}: the official code drafts from a random embedding, and "
        "no edit of config.json can give this head one of its width"
    )


def fixed_config_copy(head: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """A copy of the head in `dest` (its files symlinked, or copied where links fail) whose
    config.json lacks `target_hidden_size`, so that the official loader reads the target's
    embedding. Refused where the key differs from hidden_size (no embedding of that width)."""
    head, dest = Path(head), Path(dest)
    cfg = json.loads((head / "config.json").read_text())
    ths = cfg.pop("target_hidden_size", None)
    if ths is not None and ths != cfg.get("hidden_size"):
        raise SystemExit(
            f"--fix-config-copy: target_hidden_size {ths} != hidden_size {cfg.get('hidden_size')}"
            " in the head: removing the key would not give it a fitting embedding"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for f in head.iterdir():
        if f.name == "config.json" or not f.is_file():
            continue
        try:
            (dest / f.name).symlink_to(f.resolve())
        except OSError:
            shutil.copy2(f, dest / f.name)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dest


def official_aux_ids(num_layers: int) -> list[int]:
    """The layers whose outputs the official Llama code feeds the draft (modeling_llama_kv keeps
    the inputs of layers 2, L//2 and L-3), as config.json's eagle_aux_hidden_state_layer_ids."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def official_tree(top_k: int, depth: int, total_tokens: int) -> dict[str, int]:
    """EaModel.from_pretrained's tree arguments for our TreeConfig(top_k, depth, total_tokens)."""
    return {"top_k": top_k, "depth": depth - 1, "total_token": total_tokens}


# ---------------------------------------------------------------------------------------------
# Comparing two runs (stdlib only)
# ---------------------------------------------------------------------------------------------


def rounds_to_reach(n_tokens: int, emitted_per_round: list[int]) -> int:
    """Rounds after which 1 (the prefill's token) + the rounds' emitted tokens reach n_tokens (all
    rounds where they never do)."""
    total = 1
    for i, e in enumerate(emitted_per_round, 1):
        total += e
        if total >= n_tokens:
            return i
    return len(emitted_per_round)


def compare(ours: dict, official: dict) -> dict:
    """Our run (tokens, emitted per round, cut: whether the last round was cut at the limit / EOS)
    against the official one (tokens: input_ids after the prompt, accepted per round)."""
    n = len(ours["tokens"])
    our_acc = [e - 1 for e in ours["emitted"]]
    off_acc = official["accepted"]
    off_emitted = [a + 1 for a in off_acc]
    off_rounds = rounds_to_reach(n, off_emitted)
    first_diff = None
    for i, a in enumerate(our_acc):
        if i >= len(off_acc):
            first_diff = i + 1
            break
        last_cut = ours["cut"] and i == len(our_acc) - 1
        if (a > off_acc[i]) if last_cut else (a != off_acc[i]):
            first_diff = i + 1
            break
    if first_diff is None and len(off_acc) < len(our_acc):
        first_diff = len(off_acc) + 1
    off_tokens = official["tokens"][:n]
    first_token_diff = next(
        (i for i, (a, b) in enumerate(zip(ours["tokens"], off_tokens)) if a != b),
        None if len(off_tokens) == n else len(off_tokens),
    )
    rounds = len(our_acc)
    off_n = min(n, 1 + sum(off_emitted[:off_rounds]))
    return {
        "new_tokens": n,
        "rounds_ours": rounds,
        "rounds_official": off_rounds,
        "tau_ours": (n - 1) / rounds if rounds else float(n),
        "tau_official": (off_n - 1) / off_rounds if off_rounds else float(off_n),
        "identical_outputs": first_token_diff is None,
        "first_token_that_differs": first_token_diff,
        "first_round_that_differs": first_diff,
        "accepted_ours": our_acc,
        "accepted_official": off_acc[:off_rounds],
        "last_round_cut_ours": ours["cut"],
    }


def format_table(rows: list[dict]) -> str:
    head = ["prompt", "tokens", "rounds ours/official", "tau ours/official", "identical", "differs"]
    lines = [head]
    for r in rows:
        c = r["comparison"]
        d = c["first_round_that_differs"]
        lines.append(
            [
                r["id"],
                str(c["new_tokens"]),
                f"{c['rounds_ours']}/{c['rounds_official']}",
                f"{c['tau_ours']:.2f}/{c['tau_official']:.2f}",
                "yes" if c["identical_outputs"] else f"NO (token {c['first_token_that_differs']})",
                "-" if d is None else f"round {d}",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in lines]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# --write-target-hf: our converted target as a transformers Llama checkpoint
# ---------------------------------------------------------------------------------------------


def write_target_hf(out: Path, spec: str | None) -> None:
    """config.json + model.safetensors (+ its index, which the official draft loader reads) +
    tokenizer files of a Llama target as eagle3_jax loads it (default: the embedded SmolLM2,
    dequantised from its GGUF), in float32; lm_head.weight is written too (= the embedding when
    tied), so that no loader has to tie it."""
    import numpy as np

    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.head_config import _rope_to_hf
    from eagle3_jax.checkpoints.hf import _LAYER_KEYS, _PRE_NORMS
    from eagle3_jax.checkpoints.safetensors_io import write_safetensors
    from eagle3_jax.config import target_config_from_hf
    from eagle3_jax.models import target as tgt

    target = load_target(spec)
    cfg = target.cfg
    if cfg.family != "llama":
        raise SystemExit(
            f"--write-target-hf writes Llama targets only ({cfg.family} given): pass the model's "
            "own transformers checkpoint to --target-hf instead"
        )
    params = tgt.unstack_layers(target.params)
    tensors = {
        "model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
        "model.norm.weight": np.asarray(params["final_norm"], np.float32),
    }
    tensors["lm_head.weight"] = (
        tensors["model.embed_tokens.weight"]
        if cfg.tie_word_embeddings
        else np.asarray(params["lm_head"], np.float32).T
    )
    names = {**_LAYER_KEYS, **{k: (v, False) for k, v in _PRE_NORMS.items()}}
    for i, layer in enumerate(params["layers"]):
        for hf_name, (ours, transposed) in names.items():
            if ours in layer:
                a = np.asarray(layer[ours], np.float32)
                tensors[f"model.layers.{i}.{hf_name}"] = a.T if transposed else a
    eos = list(cfg.eos_token_ids)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": "float32",
        **_rope_to_hf(cfg.rope),
    }
    back = target_config_from_hf(hf)
    if back != cfg:
        raise SystemExit(f"config round trip failed: {back} != {cfg}")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
        "weight_map": {k: "model.safetensors" for k in sorted(tensors)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    target.tokenizer.save_pretrained(out)
    # a class name transformers 4.x knows as well ("TokenizersBackend" is 5.x's)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # what transformers 5 saves of this load
        tc.pop(key, None)
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    print(f"wrote {out} ({len(tensors)} tensors, float32, from {target.path})", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# The official side: a worker process (torch, transformers, safetensors; never jax/eagle3_jax)
# ---------------------------------------------------------------------------------------------


def _legacy_rope(cfg):
    """Shim 3: a transformers-5 config's RoPE in the form the official code (transformers 4)
    reads: rope_scaling None and rope_theta for plain RoPE, {"type", "factor"} when scaled."""
    params = getattr(cfg, "rope_parameters", None)
    if not params or getattr(cfg, "rope_theta", None) is not None:
        return cfg  # transformers 4.x: already so
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta")
    if kind == "default":
        cfg.rope_scaling = None
    elif kind in ("linear", "dynamic"):
        cfg.rope_scaling = {"type": kind, "factor": params["factor"]}
    else:
        raise SystemExit(f"official worker: RoPE type {kind!r} has no transformers-4 form here")
    if theta is not None:
        cfg.rope_theta = theta
    return cfg


def _apply_shims(log) -> None:
    import importlib
    import types

    for name, cls in (
        ("modeling_qwen2_kv", "Qwen2ForCausalLM"),
        ("modeling_qwen3_kv", "Qwen3ForCausalLM"),
        ("modeling_mixtral_kv", "MixtralForCausalLM"),
    ):
        full = f"eagle.model.{name}"
        try:
            importlib.import_module(full)
        except ImportError as e:  # shim 1
            stub = types.ModuleType(full)
            setattr(stub, cls, type(cls, (), {"__doc__": f"stub: {full} failed to import"}))
            sys.modules[full] = stub
            log(f"shim 1: {full} stubbed ({e})")
    import eagle.model.modeling_llama_kv as mlk
    from eagle.model.configs import EConfig

    if isinstance(mlk.LlamaForCausalLM._tied_weights_keys, list):  # shim 2
        import transformers

        if int(transformers.__version__.split(".")[0]) >= 5:
            mlk.LlamaForCausalLM._tied_weights_keys = {
                "lm_head.weight": "model.embed_tokens.weight"
            }
            log("shim 2: LlamaForCausalLM._tied_weights_keys as a dict")
    original = EConfig.from_pretrained.__func__  # shim 3 (draft side)
    EConfig.from_pretrained = classmethod(lambda cls, *a, **k: _legacy_rope(original(cls, *a, **k)))


def official_worker(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    log = lambda msg: print(f"[official] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()  # its load report and deprecation notes: noise
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(job["threads"])
    sys.path.insert(0, job["eagle_repo"])
    _apply_shims(log)
    from eagle.model.ea_model import EaModel
    from transformers import AutoConfig

    tcfg = _legacy_rope(AutoConfig.from_pretrained(job["target_hf"]))  # shim 3 (target side)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    t0 = time.perf_counter()
    model = EaModel.from_pretrained(
        use_eagle3=True,
        base_model_path=job["target_hf"],
        ea_model_path=job["head"],
        **job["tree"],
        config=tcfg,
        **{dtype_kw: torch.float32},
    ).eval()
    base = model.base_model
    # shim 4: rebuild the rotary buffers (the constructor's own computation: a no-op where the
    # loader kept them, as transformers 4 did); count those it changed
    before = {n: b.clone() for n, b in base.named_buffers() if "rotary_emb" in n}
    for layer in base.model.layers:
        layer.self_attn._init_rope()
    after = dict(base.named_buffers())
    changed = [n for n, b in before.items() if not torch.equal(b, after[n])]
    if changed:
        log(f"shim 4: rebuilt rotary buffers; {len(changed)} of {len(before)} had not been loaded")
    bad = [n for n, b in base.named_buffers() if not torch.isfinite(b).all()]
    if bad:
        raise SystemExit(f"official worker: non-finite buffers after loading: {bad[:3]}")
    emb = base.model.embed_tokens.weight
    checks = {"lm_head_is_embedding": bool(torch.equal(base.lm_head.weight, emb))}
    checks["draft_embedding_is_target_embedding"] = bool(
        torch.equal(model.ea_layer.embed_tokens.weight.to(emb.dtype), emb)
    )
    log(f"loaded in {time.perf_counter() - t0:.1f}s; checks {checks}")
    if tcfg.tie_word_embeddings and not checks["lm_head_is_embedding"]:
        raise SystemExit("official worker: the tied lm_head differs from the embedding")
    names_width = "target_hidden_size" in json.loads(
        (Path(job["head"]) / "config.json").read_text()
    )
    if not names_width and not checks["draft_embedding_is_target_embedding"]:
        raise SystemExit("official worker: the draft did not get the target's embedding")
    results = []
    for p in job["prompts"]:
        ids = torch.tensor([p["ids"]], dtype=torch.long)
        n0 = prev = ids.shape[1]
        accepted, out = [], ids
        t0 = time.perf_counter()
        with torch.inference_mode():
            for out in model.ea_generate(
                ids, temperature=0.0, max_new_tokens=job["max_new_tokens"]
            ):
                accepted.append(int(out.shape[1]) - prev - 1)
                prev = int(out.shape[1])
        wall = time.perf_counter() - t0
        tokens = [int(t) for t in out[0, n0:]]
        log(f"{p['id']}: {len(tokens)} tokens in {len(accepted)} rounds, {wall:.1f}s")
        results.append({"id": p["id"], "tokens": tokens, "accepted": accepted, "wall_s": wall})
    meta = {
        "python": sys.executable,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "checks": checks,
        "eos_token_id": model.tokenizer.eos_token_id,
    }
    Path(result_path).write_text(json.dumps({"meta": meta, "results": results}))


def run_official(args, head: Path, prompts: list[dict], tmp: Path) -> dict:
    job = {
        "eagle_repo": str(Path(args.eagle_repo).resolve()),
        "target_hf": str(Path(args.target_hf).resolve()),
        "head": str(head.resolve()),
        "tree": official_tree(args.top_k, args.depth, args.total_tokens),
        "max_new_tokens": args.max_new_tokens,
        "threads": args.official_threads,
        "prompts": prompts,
    }
    job_path, result_path = tmp / "job.json", tmp / "official.json"
    job_path.write_text(json.dumps(job))
    python = args.official_python or sys.executable
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--official-worker",
        str(job_path),
        str(result_path),
    ]
    print(f"official side: {' '.join(cmd)}", file=sys.stderr, flush=True)
    res = subprocess.run(cmd, cwd=tmp)
    if res.returncode != 0 or not result_path.is_file():
        raise SystemExit(
            f"the official worker failed (exit {res.returncode}); see its output above"
        )
    return json.loads(result_path.read_text())


# ---------------------------------------------------------------------------------------------
# Our side
# ---------------------------------------------------------------------------------------------


def run_ours(args, head: Path, prompt_texts: list[tuple[str, str]]):
    """(prompts as {id, text, ids}, our per-prompt runs, metadata)."""
    import jax
    import jax.numpy as jnp

    from eagle3_jax import compile_cache
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.checkpoints.heads import load_head
    from eagle3_jax.decoding.generate import DecodeOptions, stream_ids
    from eagle3_jax.prompts import encode_chat

    compile_cache.enable()
    t0 = time.perf_counter()
    target = load_target(args.target_hf, dtype=jnp.float32)
    loaded = load_head(str(head), target, jnp.float32, "full")
    dcfg = loaded.cfg
    print(f"ours: loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    tree = TreeConfig(top_k=args.top_k, depth=args.depth, total_tokens=args.total_tokens)
    tree = tree.validate(dcfg.draft_vocab_size)
    opts = DecodeOptions("eagle3", args.max_new_tokens, tree)
    eos = tuple(target.cfg.eos_token_ids)
    prompts, runs = [], []
    for pid, text in prompt_texts:
        ids = encode_chat(target.tokenizer, [{"role": "user", "content": text}])
        prompts.append({"id": pid, "text": text, "ids": ids})
        chunks, t0 = [], time.perf_counter()
        for chunk in stream_ids(target, loaded, ids, opts):
            chunks.append(chunk)
        wall = time.perf_counter() - t0
        tokens = [t for c in chunks for t in c]
        emitted = [len(c) for c in chunks[1:]]
        cut = len(tokens) >= args.max_new_tokens or (bool(tokens) and tokens[-1] in eos)
        print(
            f"ours: {pid}: {len(tokens)} tokens in {len(emitted)} rounds, {wall:.1f}s "
            "(compiling included on the first prompt)",
            file=sys.stderr,
            flush=True,
        )
        runs.append({"tokens": tokens, "emitted": emitted, "cut": cut, "wall_s": wall})
    meta = {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "eos_token_ids": list(eos),
        "draft_vocab_size": dcfg.draft_vocab_size,
        "aux_layer_ids": list(dcfg.aux_layer_ids),
        "tree": {"top_k": tree.top_k, "depth": tree.depth, "total_tokens": tree.total_tokens},
    }
    return prompts, runs, meta, target.tokenizer


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--eagle-repo", help="checkout of github.com/SafeAILab/EAGLE (unmodified)")
    p.add_argument(
        "--target-hf",
        help="transformers Llama checkpoint directory of the target (both sides load it)",
    )
    p.add_argument(
        "--write-target-hf",
        metavar="OUT",
        help="write --target (default: the embedded SmolLM2-135M-Instruct) as a transformers "
        "checkpoint to OUT and exit",
    )
    p.add_argument(
        "--target", default=None, help="with --write-target-hf: what to write (as decode.py's)"
    )
    p.add_argument("--head", default=str(DEFAULT_HEAD), help="EAGLE-3 head directory")
    p.add_argument(
        "--fix-config-copy",
        action="store_true",
        help="run the official side on a temp copy of the head without target_hidden_size",
    )
    p.add_argument("--prompts", help='JSONL file, one {"prompt": ...} (or "id") per line')
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--top-k", type=int, default=10, help="ours and official top_k")
    p.add_argument("--depth", type=int, default=8, help="ours; official depth = this - 1")
    p.add_argument("--total-tokens", type=int, default=60, help="ours and official total_token")
    p.add_argument("--official-python", help="interpreter for the official side")
    p.add_argument("--official-threads", type=int, default=1, help="torch threads, official side")
    p.add_argument("--out", help="write the full results as JSON here")
    p.add_argument("--official-worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def read_prompts(path: str | None) -> list[tuple[str, str]]:
    if path is None:
        return list(PROMPTS)
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").split("\n"), 1):
        if line.strip():
            rec = json.loads(line)
            out.append((str(rec.get("id", n)), rec["prompt"]))
    if not out:
        raise SystemExit(f"{path} holds no prompts")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.official_worker:
        official_worker(*args.official_worker)
        return 0
    if args.write_target_hf:
        write_target_hf(Path(args.write_target_hf), args.target)
        return 0
    if not args.eagle_repo or not args.target_hf:
        raise SystemExit("give --eagle-repo and --target-hf (or --write-target-hf OUT first)")
    if not (Path(args.eagle_repo) / "eagle" / "model" / "ea_model.py").is_file():
        raise SystemExit(f"{args.eagle_repo} has no eagle/model/ea_model.py: not an EAGLE checkout")
    head = Path(args.head)
    prompt_texts = read_prompts(args.prompts)
    issue = official_embedding_issue(head)
    if issue:
        print(f"WARNING: {issue}", flush=True)
    with tempfile.TemporaryDirectory(prefix="crosscheck_") as tmp_name:
        tmp = Path(tmp_name)
        official_head = head
        if args.fix_config_copy:
            official_head = fixed_config_copy(head, tmp / "head")
            print(f"--fix-config-copy: the official side reads {official_head}", flush=True)
        head_cfg = json.loads((official_head / "config.json").read_text())
        target_cfg = json.loads((Path(args.target_hf) / "config.json").read_text())
        if (
            "target_hidden_size" not in head_cfg
            and not (Path(args.target_hf) / "model.safetensors.index.json").is_file()
        ):
            raise SystemExit(
                f"{args.target_hf} has no model.safetensors.index.json, through which the "
                "official draft loader finds the target's embedding: write the target with "
                "--write-target-hf, or add an index naming its safetensors file(s)"
            )
        aux = (head_cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        want = official_aux_ids(int(target_cfg["num_hidden_layers"]))
        if aux is not None and list(aux) != want:
            print(
                f"WARNING: the head's eagle_aux_hidden_state_layer_ids {aux} are not the layers "
                f"the official Llama code feeds ({want}): it ignores them, so the sides differ",
                flush=True,
            )
        prompts, ours, our_meta, tok = run_ours(args, head, prompt_texts)
        official = run_official(args, official_head, prompts, tmp)
    rows = []
    for p, o, r in zip(prompts, ours, official["results"]):
        c = compare(o, r)
        rows.append(
            {
                "id": p["id"],
                "prompt": p["text"],
                "prompt_ids": p["ids"],
                "comparison": c,
                "ours": {**o, "text": tok.decode(o["tokens"], skip_special_tokens=True)},
                "official": {**r, "text": tok.decode(r["tokens"], skip_special_tokens=True)},
            }
        )
    tree = our_meta["tree"]
    copy_note = (
        " (official side: a copy without target_hidden_size)" if args.fix_config_copy else ""
    )
    print(
        f"\nhead {head}{copy_note}; "
        f"tree ours top-k {tree['top_k']} depth {tree['depth']} total {tree['total_tokens']} = "
        f"official {official_tree(**tree)}; max new tokens {args.max_new_tokens}; greedy, float32"
    )
    print(format_table(rows))
    n_same = sum(r["comparison"]["first_round_that_differs"] is None for r in rows)
    print(f"{n_same}/{len(rows)} prompts accept the same tokens in every round")
    if args.out:
        doc = {
            "args": {k: v for k, v in vars(args).items() if k != "official_worker"},
            "head_issue": issue,
            "ours_meta": our_meta,
            "official_meta": official["meta"],
            "official_tree": official_tree(**tree),
            "prompts": rows,
        }
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The official side: a worker process (torch, transformers, safetensors; never jax or
eagle3_jax, so that --official-python may name an interpreter without them), its shims, and the
call that runs it (scripts/crosscheck_official.py --official-worker JOB RESULT)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from crosscheck.head import official_tree

SCRIPT = Path(__file__).resolve().parent.parent / "crosscheck_official.py"


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
        str(SCRIPT),
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

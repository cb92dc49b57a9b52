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
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # crosscheck/, however this is loaded

from crosscheck.compare import compare, format_table
from crosscheck.head import (
    fixed_config_copy,
    official_aux_ids,
    official_embedding_issue,
    official_tree,
)
from crosscheck.official import official_worker, run_official
from crosscheck.ours import run_ours
from crosscheck.target_hf import write_target_hf

REPO = Path(__file__).resolve().parent.parent
DEFAULT_HEAD = REPO / "eagle3_jax" / "heads" / "smollm2_135m_instruct"
PROMPTS = [
    ("explain", "What is speculative decoding? Answer in three sentences."),
    (
        "code",
        "Write a Python function that checks whether a string is a palindrome, ignoring case "
        "and punctuation, with a docstring and two examples.",
    ),
    ("list", "List three uses of a paperclip."),
]


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

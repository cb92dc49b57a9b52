"""Train an EAGLE-3 draft head for a target model.

  python -m eagle3_jax train --config=configs/smollm2_135m.py                      # the embedded default, CPU
  python -m eagle3_jax train --config=configs/smollm2_135m.py --resume             # continue after a stop
  python -m eagle3_jax train --config=configs/llama31_8b.py --config.target=/ckpt/Llama-3.1-8B-Instruct

Any config field can be overridden with --config.FIELD=VALUE or --config.GROUP.FIELD=VALUE (the
groups corpus, store, head, optim, compute, run: eagle3_jax/training/config_groups.py). A second
--precompute-features into the same features_dir is refused while the first runs.
Outputs under out_dir: regenerated.jsonl, dataset.npz, vocab.npz, checkpoints/, metrics.jsonl and,
at the end, head/ in the official EAGLE-3 format (usable with decode.py --draft, SGLang, vLLM).
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_jax import compile_cache, distributed
from eagle3_jax.errors import Eagle3Error, Stopped
from eagle3_jax.training.config import load_config
from eagle3_jax.training.loop import train
from eagle3_jax.training.prepare import precompute_features


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", required=True, help="a configs/*.py file defining get_config()")
    p.add_argument("--resume", action="store_true", help="continue the run in out_dir")
    p.add_argument(
        "--precompute-features",
        action="store_true",
        help="prepare the data and write the target's features to features_dir, then stop",
    )
    p.add_argument("--no-progress", action="store_true")
    args, overrides = p.parse_known_args(argv)

    compile_cache.enable()
    try:
        distributed.initialize()  # a pod / SLURM / multi-process job: join it first
        tc = load_config(args.config.removeprefix("="), overrides)
        if args.precompute_features:
            summary = {"features_dir": str(precompute_features(tc, progress=not args.no_progress))}
        else:
            summary = train(tc, resume=args.resume, progress=not args.no_progress)
    except Eagle3Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Stopped as e:
        print(e, file=sys.stderr)
        return e.EXIT_STATUS
    print(json.dumps(summary, indent=1))
    return 0

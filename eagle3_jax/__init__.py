"""eagle3_jax: EAGLE-3 speculative decoding in JAX: train draft heads, decode with draft trees.

    import eagle3_jax as e3

    target = e3.load_target()                        # the embedded SmolLM2-135M-Instruct
    head = e3.load_head(e3.default_head(), target)   # its shipped EAGLE-3 head
    out = e3.generate(target, ["Explain speculative decoding."], 64, head=head)
    print(out.texts[0], out.tau)                     # tokens per target pass

The public names, each documented where it is defined:

  load_target, Target          a target model (HF safetensors dir, GGUF, or the default), on a mesh
  load_head, Head, save_head   an EAGLE-3 head (official or speculators layout) in and out
  default_head                 the shipped head of the default target
  generate, Generation         decode prompts: eagle3 / pld / vanilla, greedy or sampled
  TreeConfig, default_tree     the draft tree (top-k, depth, nodes verified, adaptive threshold)
  Sampling                     temperature / top-k / top-p
  evaluate, EvalOptions        the harness: methods x benchmarks, resumable, one report
  train, TrainConfig, load_config   train a head from a config
  make_mesh                    the (data, model) device mesh
  TargetConfig, DraftConfig    frozen model configs
  Eagle3Error                  the one error type bad input raises

Dimension legend (names, shape suffixes and einsum subscripts use these letters): B batch,
T tokens, D hidden, V vocabulary, Vd draft vocabulary, H attention heads, G kv heads, K head dim,
S cache slots, N tree nodes, W top-k width, L layers, F MLP width; E experts in a routed
(mixture-of-experts) MLP.
"""

from eagle3_jax.checkpoints import Target, load_target
from eagle3_jax.checkpoints.eagle_format import save_draft as save_head
from eagle3_jax.checkpoints.heads import Head, load_head
from eagle3_jax.config import TargetConfig
from eagle3_jax.decoding.generate import Generation, generate
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.decoding.tree import TreeConfig, default_tree
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.evaluation.options import EvalOptions
from eagle3_jax.evaluation.runner import run_eval as evaluate
from eagle3_jax.heads import default_head
from eagle3_jax.models.draft import DraftConfig
from eagle3_jax.sharding import make_mesh
from eagle3_jax.training.config import TrainConfig, load_config
from eagle3_jax.training.loop import train

__all__ = [
    "DraftConfig",
    "Eagle3Error",
    "EvalOptions",
    "Generation",
    "Head",
    "Sampling",
    "Target",
    "TargetConfig",
    "TrainConfig",
    "TreeConfig",
    "default_head",
    "default_tree",
    "evaluate",
    "generate",
    "load_config",
    "load_head",
    "load_target",
    "make_mesh",
    "save_head",
    "train",
]

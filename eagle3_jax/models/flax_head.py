"""The EAGLE-3 draft head as a Flax NNX module, for users who build their models with Flax.

The head itself is functional (`models.draft`: a params pytree and pure functions, what the
decoding and training code jits); this module holds the same pytree as `nnx.Param` leaves and
calls the same `draft.forward`, so a head can sit inside a Flax model, be split and merged with
`nnx.split` / `nnx.merge`, and be trained with `nnx.Optimizer`, and its `params` still load and
save as any other head's (`load_head` / `save_head`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from eagle3_jax.models import draft as drf


def _is_param(x) -> bool:
    return isinstance(x, nnx.Param)


class DraftHead(nnx.Module):
    """An EAGLE-3 head: fc fusion of the target's aux states, one decoder layer, lm_head over Vd.

    Args:
      cfg: the head's DraftConfig (static).
      params: a head's params pytree (`load_head(...).params`), or None to initialise randomly
        from `rngs` (normal(0, scale) matrices, unit norms: `draft.init_params`).
    """

    def __init__(
        self,
        cfg: drf.DraftConfig,
        params: drf.Params | None = None,
        *,
        rngs: nnx.Rngs | None = None,
        dtype=jnp.float32,
        scale: float = 0.02,
    ):
        if params is None:
            if rngs is None:
                raise ValueError("DraftHead needs params or rngs to initialise them")
            params = drf.init_params(cfg, rngs.params(), dtype, scale)
        drf.check_params(params, cfg)
        self.cfg = cfg
        self.weights = nnx.data(jax.tree.map(nnx.Param, params))

    @property
    def params(self) -> drf.Params:
        """The head's params as the plain pytree the functional code and `save_head` take."""
        return jax.tree.map(lambda p: p[...], self.weights, is_leaf=_is_param)

    def __call__(
        self,
        embed_VD: jax.Array,
        tokens_BT: jax.Array,
        feat_BTX: jax.Array,
        positions_BT: jax.Array,
        mask: jax.Array,
        cache: dict[str, jax.Array] | None = None,
        write_B: jax.Array | None = None,
        target_features: bool | None = None,
    ) -> drf.Output:
        """One draft step over T positions: `draft.forward` with this module's params (shapes
        there: hidden [B, T, D], logits [B, T, Vd], the updated cache)."""
        return drf.forward(self.params, embed_VD, tokens_BT, feat_BTX, positions_BT, mask,
                           self.cfg, cache, write_B, target_features=target_features)  # fmt: skip

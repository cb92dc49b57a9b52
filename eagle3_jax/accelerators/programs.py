"""Every jitted program, as a TPU or GPU would be handed it at real sizes, without one: the plain
and speculative prefills, the plain decode step, the speculative round (a tree and a chain), the
TTT training step and the server's programs (an admission into a slot, a round over the busy
slots' rows, an echoed prompt's scoring), each a `Program` whose arguments are
`jax.ShapeDtypeStruct`s laid out with the project's own shardings on a (data, model) mesh. No
weights are allocated and nothing is compiled, so this runs on a CPU-only machine (with
simulated CPU devices for the mesh: XLA_FLAGS=--xla_force_host_platform_device_count=8).
`lowering` exports and inspects them.

The targets are the published checkpoints' config.json fields (`specs.REAL_TARGETS`); heads are
sized like the target with EAGLE-3's 32k draft vocabulary (`specs.draft_for`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.accelerators.specs import DRAFT_VOCAB, draft_for, target_config
from eagle3_jax.backends import attention_wanted, fuse_projections_wanted, routed_as_wanted
from eagle3_jax.config import DraftConfig, TargetConfig
from eagle3_jax.decoding import plain, slots
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import RowSampling, Sampling
from eagle3_jax.decoding.tree import ACCELERATOR_TREE, TreeConfig
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh, named
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.step import TrainState, jit_train_step, make_optimizer
from eagle3_jax.vocab import DraftVocab

# the training configs' (data, model) split of 8 chips (configs/llama31_8b.py, qwen3_4b.py; OLMo 2
# 7B has none: as Llama's); a batch the data axis does not divide trains on 1 x 8
TRAIN_MESH = {"llama31_8b": (2, 4), "olmo2_7b": (2, 4), "qwen3_4b": (4, 2)}

# a chain as deep as the reporting tree (`decoding.tree.default_tree` with top_k 1)
CHAIN_TREE = TreeConfig(
    top_k=1, depth=ACCELERATOR_TREE.depth, total_tokens=ACCELERATOR_TREE.depth + 1
)
# the backend whose engine choices the programs take; a GPU's differ in its attention (the Pallas
# kernel on one GPU) and a routed target's dispatch (gather, not ragged: `backends`)
ACCELERATOR = "tpu"
PROGRAMS = ("prefill", "spec_prefill", "decode_step", "round_tree", "round_chain", "train_step",
            "serve_admit", "serve_round", "serve_score", "serve_chunk")  # fmt: skip
SERVE_LOGPROBS = 20  # what `serve --max-logprobs` allows at most
SERVE_CHUNK = 512  # `serve --prefill-chunk`'s chunk in `serve_chunk`

# ----------------------------------------------------------------------------- abstract inputs


def _sds(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _with_shardings(avals, shardings):
    return jax.tree.map(_sds, avals, shardings)


def abstract_target(tcfg: TargetConfig, mesh: Mesh, dtype=jnp.bfloat16, fused: bool = False):
    """The target's params as ShapeDtypeStructs laid out as the loaders place them (a list of
    layers, `target.param_shardings`): no weight is allocated. `fused`: q/k/v and gate/up fused
    where the mesh allows, as `backends.prepare_target` leaves them for decoding."""
    qkv, gate_up = tgt.fusable(tcfg, mesh) if fused else (False, False)

    def make(key):
        p = tgt.init_params(tcfg, key, dtype)
        return {**p, "layers": [tgt.fuse_layer(lp, tcfg, qkv, gate_up) for lp in p["layers"]]}

    shapes = jax.eval_shape(make, jax.random.key(0))
    return _with_shardings(shapes, tgt.param_shardings(tcfg, mesh, fused=(qkv, gate_up)))


def abstract_draft(dcfg: DraftConfig, mesh: Mesh, dtype=jnp.bfloat16):
    """The head's params, laid out as `checkpoints.heads.load_head` places them."""
    shapes = jax.eval_shape(lambda k: drf.init_params(dcfg, k, dtype), jax.random.key(0))
    return _with_shardings(shapes, drf.param_shardings(dcfg, mesh))


def abstract_vocab(dcfg: DraftConfig, mesh: Mesh) -> DraftVocab:
    rep = NamedSharding(mesh, P())
    return DraftVocab(
        jax.ShapeDtypeStruct((dcfg.draft_vocab_size,), jnp.int32, sharding=rep),
        jax.ShapeDtypeStruct((dcfg.vocab_size,), jnp.bool_, sharding=rep),
    )


def _rows(mesh: Mesh, x) -> NamedSharding:
    """Batch-leading state arrays: rows over `data` where it divides, the rest replicated."""
    if not x.shape:
        return NamedSharding(mesh, P())
    return named(mesh, ("batch",) + (None,) * (len(x.shape) - 1), x.shape)


def _new_kv(mesh: Mesh, x) -> NamedSharding:
    """[L, B, T, G, K] new keys/values (a speculative round's pending path): as the cache."""
    return named(mesh, (None, "batch", None, "kv_heads", None), x.shape)


def decode_state_shardings(state, tcfg: TargetConfig, mesh: Mesh, batch: int):
    """A DecodeState's layout: the cache as `target.make_cache` lays it out, rows over data."""
    rest = jax.tree.map(lambda x: _rows(mesh, x), state._replace(cache=None))
    return rest._replace(cache=tgt.cache_sharding(tcfg, mesh, batch))


def spec_state_shardings(state, tcfg: TargetConfig, dcfg: DraftConfig, mesh: Mesh, batch: int):
    """A SpecState's layout: both caches over (batch, kv heads), pending K/V likewise, rows over
    data, the key replicated."""
    rest = jax.tree.map(
        lambda x: _rows(mesh, x),
        dataclasses.replace(state, tcache=None, dcache=None, pending_kv=None),
    )
    return dataclasses.replace(
        rest,
        tcache=tgt.cache_sharding(tcfg, mesh, batch),
        dcache=drf.cache_sharding(dcfg, mesh, batch),
        pending_kv=jax.tree.map(lambda x: _new_kv(mesh, x), state.pending_kv),
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    """One configuration to export: a target, a batch, a context and a mesh."""

    target: str = "llama31_8b"
    batch: int = 1
    prompt: int = 1024  # prompt tokens (prefill length)
    new: int = 1024  # new tokens: the cache holds prompt + new (+ a round's slots)
    mesh: tuple[int, int] = (1, 8)  # (data, model) for decoding
    tree: TreeConfig = ACCELERATOR_TREE
    train_len: int = 2048  # training sequence length (the configs' max_len)
    ttt_steps: int = 7

    @property
    def train_mesh(self) -> tuple[int, int]:
        """The training config's split where the mesh is its 8 chips and the data axis divides
        the batch, else the decoding mesh."""
        data, model = TRAIN_MESH.get(self.target, self.mesh)
        if data * model != self.mesh[0] * self.mesh[1] or self.batch % data:
            return self.mesh
        return data, model


def _mesh(shape: tuple[int, int]) -> Mesh:
    data, model = shape
    if len(jax.devices()) < data * model:
        raise Eagle3Error(
            f"a {data}x{model} mesh needs {data * model} devices, {len(jax.devices())} present: "
            "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax is imported"
        )
    return make_mesh(data, model, jax.devices()[: data * model])


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Program:
    """A jitted function with abstract arguments, ready to export."""

    name: str
    fn: Any
    args: tuple
    kwargs: dict
    mesh: Mesh
    groups: dict[str, int]  # name -> how many leading flattened args belong to it (in order)
    want_dtype: Any = jnp.bfloat16  # float buffers of the state should be this
    state_arg: int | None = None  # which positional argument is the (donated) state


def _plain_shape(s: Setup, extra: int = 0) -> plain.Shape:
    return plain.plan_shape([s.prompt] * s.batch, s.new, s.prompt + s.new + extra + 1, extra)


def _count(*trees) -> int:
    return sum(len(jax.tree.leaves(t)) for t in trees)


def _prompt_args(mesh: Mesh, b: int, t: int):
    """Prompts [B, T], lengths [B], limits [B] (rows over data) and a PRNG key (replicated)."""

    def rows(shape, dtype):
        return jax.ShapeDtypeStruct(
            shape, dtype, sharding=_rows(mesh, jax.ShapeDtypeStruct(shape, dtype))
        )

    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=NamedSharding(mesh, P()))
    return rows((b, t), jnp.int32), rows((b,), jnp.int32), rows((b,), jnp.int32), key


def build(name: str, s: Setup, sampling: Sampling = Sampling()) -> Program:
    """The named program (`PROGRAMS`) of a setup, with abstract, sharded arguments. Decoding
    programs are the ones an accelerator runs (`backends`): bf16 weights, q/k/v and gate/up
    fused where the mesh allows, the attention bf16 weights get there, a routed target's experts
    dispatched as there (`backends.routed_as_wanted`: each device on its own rows and experts)."""
    tcfg = target_config(s.target)
    dcfg = draft_for(tcfg)
    b = s.batch
    if name == "train_step":
        return _train_program(s, tcfg, dcfg)
    mesh = _mesh(s.mesh)
    tcfg = dataclasses.replace(tcfg, attention=attention_wanted(jnp.bfloat16, ACCELERATOR))
    tcfg = routed_as_wanted(tcfg, ACCELERATOR, mesh)
    tparams = abstract_target(tcfg, mesh, fused=fuse_projections_wanted(ACCELERATOR))
    eos = tcfg.eos_token_ids
    if name in ("prefill", "decode_step"):
        shape = _plain_shape(s)
        prompt = _prompt_args(mesh, b, shape.prompt_len)
        kw = dict(cfg=tcfg, shape=shape, sampling=sampling, eos_ids=eos)
        if name == "prefill":
            return Program(
                name, plain.prefill, (tparams, *prompt), {**kw, "mesh": mesh}, mesh,
                {"params": _count(tparams), "inputs": 4},
            )  # fmt: skip
        state = jax.eval_shape(functools.partial(plain.prefill, **kw, mesh=mesh), tparams, *prompt)
        state = _with_shardings(state, decode_state_shardings(state, tcfg, mesh, b))
        return Program(
            name, plain.decode_step, (tparams, state), kw, mesh,
            {"params": _count(tparams), "state": _count(state)}, state_arg=1,
        )  # fmt: skip
    tree = CHAIN_TREE if name == "round_chain" else s.tree
    tree = tree.validate(dcfg.draft_vocab_size)
    shape = _plain_shape(s, tree.round_slots + 1)
    dparams = abstract_draft(dcfg, mesh)
    vocab = abstract_vocab(dcfg, mesh)
    embed = tparams["embed"]
    prompt = _prompt_args(mesh, b, shape.prompt_len)
    kw = dict(tcfg=tcfg, dcfg=dcfg, shape=shape, tree=tree, sampling=sampling, eos_ids=eos)
    head = (tparams, dparams, embed, vocab)
    # the embedding is the target's own buffer, passed again: "shared" is not counted twice
    groups = {"params": _count(tparams), "head": _count(dparams), "shared": 1, "vocab": 2}
    if name.startswith("serve_"):
        return _serve_program(name, s, tcfg, dcfg, head, mesh, groups)
    if name == "spec_prefill":
        return Program(
            name, spec.prefill, (*head, *prompt), {**kw, "mesh": mesh}, mesh,
            {**groups, "inputs": 4},
        )  # fmt: skip
    if name not in ("round_tree", "round_chain"):
        raise Eagle3Error(f"unknown program {name!r}: choose one of {', '.join(PROGRAMS)}")
    state = jax.eval_shape(functools.partial(spec.prefill, **kw, mesh=mesh), *head, *prompt)
    state = _with_shardings(state, spec_state_shardings(state, tcfg, dcfg, mesh, b))
    return Program(
        name, spec.round_step, (*head, state), {**kw, "method": "eagle3"}, mesh,
        {**groups, "state": _count(state)}, state_arg=4,
    )  # fmt: skip


def _serve_program(name: str, s: Setup, tcfg, dcfg, head: tuple, mesh: Mesh,
                   groups: dict[str, int]) -> Program:  # fmt: skip
    """A server's programs (`decoding.slots.SlotEngine`) over `s.batch` slots of `s.prompt` +
    `s.new` tokens, its state laid out as the engine lays it out (`slots.state_shardings`), with
    the engine's static arguments (`slots.ROWS_SAMPLE`: each row's own sampling in the state),
    the largest `--max-logprobs` kept: `serve_admit` one request's prefill into a slot,
    `serve_round` a round over half the slots' rows (`speculative.rows_round`, the target cache
    read in place; all of them with one slot), `serve_score` an echoed prompt's
    log-probabilities (`slots.score_prompt`), `serve_chunk` one chunk of SERVE_CHUNK prompt
    tokens of a chunked admission (`plain.prefill_chunk`, into a batch of one's cache of the
    slots' S). `groups`: the head's, as `build` counts them."""
    b, tree = s.batch, s.tree.validate(dcfg.draft_vocab_size)
    cache = plain.round_up(s.prompt + s.new + tree.round_slots + 1, plain.PROMPT_BUCKET)
    shape = plain.Shape(b, 0, cache, plain.round_up(s.new, plain.NEW_BUCKET),
                        logprobs=SERVE_LOGPROBS, row_widths=slots.row_widths(tcfg.vocab_size))  # fmt: skip
    bucket = plain.round_up(s.prompt, plain.PROMPT_BUCKET)
    rep = NamedSharding(mesh, P())

    def replicated(shape_, dtype):
        return jax.ShapeDtypeStruct(shape_, dtype, sharding=rep)

    prompt = replicated((1, bucket), jnp.int32)
    groups = dict(groups)
    if name == "serve_score":
        return Program(name, slots.score_prompt, (head[0], prompt),
                       {"tcfg": tcfg, "k": SERVE_LOGPROBS}, mesh,
                       {"params": groups["params"], "inputs": 1})  # fmt: skip
    if name == "serve_chunk":
        stacked = not isinstance(head[0]["layers"], list)
        row = jax.eval_shape(lambda: tgt.make_cache(tcfg, 1, cache, jnp.bfloat16, stacked=stacked))
        row = _with_shardings(row, tgt.cache_sharding(tcfg, mesh, 1, stacked=stacked))
        args = (head[0], row, replicated((1, 1, tcfg.vocab_size), jnp.float32),
                replicated((1, SERVE_CHUNK), jnp.int32), replicated((), jnp.int32),
                replicated((1,), jnp.int32))  # fmt: skip
        return Program(name, plain.prefill_chunk, args,
                       {"cfg": tcfg, "aux_ids": dcfg.aux_layer_ids}, mesh,
                       {"params": groups["params"], "state": _count(row), "inputs": 4},
                       state_arg=1)  # fmt: skip
    eos = tcfg.eos_token_ids
    state = slots.state_shapes(head, tcfg, dcfg, shape, tree, eos)
    state = _with_shardings(state, slots.state_shardings(state, tcfg, dcfg, mesh, b))
    kw = dict(tcfg=tcfg, dcfg=dcfg, shape=shape, tree=tree, sampling=slots.ROWS_SAMPLE,
              eos_ids=eos)  # fmt: skip
    groups["state"] = _count(state)
    if name == "serve_admit":
        one = dataclasses.replace(shape, batch=1, prompt_len=bucket)
        rows = jax.tree.map(lambda x: replicated(x.shape, x.dtype),
                            RowSampling.fill(slots.ROWS_SAMPLE, 1, shape.row_widths))  # fmt: skip
        args = (*head, state, replicated((), jnp.int32), prompt, replicated((1,), jnp.int32),
                replicated((1,), jnp.int32), replicated((2,), jnp.uint32))  # fmt: skip
        return Program(name, slots.admit_row, args, {**kw, "shape": one, "rows": rows}, mesh,
                       {**groups, "inputs": 5 + len(jax.tree.leaves(rows))}, state_arg=4)  # fmt: skip
    if name != "serve_round":
        raise Eagle3Error(f"unknown program {name!r}: choose one of {', '.join(PROGRAMS)}")
    if b == 1:
        return Program(name, spec.round_step, (*head, state), {**kw, "method": "eagle3"}, mesh,
                       groups, state_arg=4)  # fmt: skip
    rows_b = replicated((b // 2,), jnp.int32)
    return Program(name, spec.rows_round, (*head, state, rows_b), {**kw, "method": "eagle3"},
                   mesh, {**groups, "inputs": 1}, state_arg=4)  # fmt: skip


def train_config(s: Setup) -> TrainConfig:
    data, model = s.train_mesh
    return TrainConfig().replace(
        max_len=s.train_len,
        draft_vocab_size=DRAFT_VOCAB,
        ttt_steps=s.ttt_steps,
        batch_size=s.batch,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
        mesh_data=data,
        mesh_model=model,
    )


def _opt_shardings(opt_state, params, pshard, rep):
    """The optimiser state's layout as `training.step.init_state` leaves it: the moments as the
    params they follow, counters replicated."""
    ptree = jax.tree.structure(params)

    def place(sub):
        if jax.tree.structure(sub) == ptree:
            return pshard
        return jax.tree.map(lambda _: rep, sub)

    return jax.tree.map(
        place, opt_state, is_leaf=lambda x: x is not None and jax.tree.structure(x) == ptree
    )


def _train_program(s: Setup, tcfg: TargetConfig, dcfg: DraftConfig) -> Program:
    tc = train_config(s)
    mesh = _mesh(s.train_mesh)
    tcfg = routed_as_wanted(tcfg, ACCELERATOR, mesh)  # training's forward, as `training.loop`'s
    rep = NamedSharding(mesh, P())
    tx = make_optimizer(tc.optim, 1000)
    tparams = abstract_target(tcfg, mesh, jnp.bfloat16)
    dparams = abstract_draft(dcfg, mesh, jnp.bfloat16)
    pshard = drf.param_shardings(dcfg, mesh)
    state = jax.eval_shape(lambda p: TrainState(jnp.zeros((), jnp.int32), p, tx.init(p)), dparams)
    state_sh = TrainState(rep, pshard, _opt_shardings(state.opt_state, dparams, pshard, rep))
    state = _with_shardings(state, state_sh)
    batch_sh = NamedSharding(mesh, P("data"))
    bt = (s.batch, s.train_len)
    batch = {
        "input_ids": jax.ShapeDtypeStruct(bt, jnp.int32, sharding=batch_sh),
        "loss_mask": jax.ShapeDtypeStruct(bt, jnp.float32, sharding=batch_sh),
        "attention_mask": jax.ShapeDtypeStruct(bt, jnp.int32, sharding=batch_sh),
    }
    t2d = jax.ShapeDtypeStruct((tcfg.vocab_size,), jnp.bool_, sharding=rep)
    step = jit_train_step(
        tcfg, dcfg, tc, tx, mesh, state_sh, jax.tree.map(lambda x: x.sharding, tparams)
    )
    return Program(
        "train_step", step, (state, tparams, batch, t2d), {}, mesh,
        {"state": _count(state), "params": _count(tparams), "batch": 3, "t2d": 1}, state_arg=0,
    )  # fmt: skip

"""Every jitted program, lowered for TPUs and GPUs at real sizes without one: `jax.export` of the
prefills, the speculative round, the plain decode step and the TTT training step, from
`jax.ShapeDtypeStruct`s laid out with the project's own shardings on a (data, model) mesh. No
weights are allocated and nothing is compiled, so this runs on a CPU-only machine (with simulated
CPU devices for the mesh: XLA_FLAGS=--xla_force_host_platform_device_count=8).

`export_program` exports one program for `platforms` (("tpu", "cuda") by default) and inspects the
result (`Report`): the StableHLO's custom-call targets (a host callback, or a kernel only the CPU
backend has, fails `problems`), float buffers in the state that are not in the dtype asked for,
and any backend compilation while tracing (a probe that runs at trace time: on a TPU host it
would run there, once per trace, or fail). Sizes in HBM per device (`Memory`): parameters and KV
caches from the exported inputs' avals and shardings; activations (a verification of the tree's
nodes, a prefill, a TTT step) counted from the shapes, since XLA's memory analysis needs a compile
for the target backend. `fits` compares them with a device's memory (`DEVICES`).

The configs are the published checkpoints' config.json fields (`REAL_TARGETS`), turned into
TargetConfigs by the loaders' own `target_config_from_hf`; heads are sized like the target with
EAGLE-3's 32k draft vocabulary, as the published heads are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import (
    ACCELERATOR_TREE,
    PLAIN_PRODUCTS,
    DraftConfig,
    TargetConfig,
    TreeConfig,
    target_config_from_hf,
)
from eagle3_jax.decoding import plain
from eagle3_jax.decoding import speculative as spec
from eagle3_jax.decoding.sampling import Sampling
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.sharding import make_mesh, named
from eagle3_jax.training.config import TrainConfig
from eagle3_jax.training.step import TrainState, jit_train_step, make_optimizer
from eagle3_jax.vocab import DraftVocab

PLATFORMS = ("tpu", "cuda")

# config.json fields of the published checkpoints (what `target_config_from_hf` reads)
REAL_TARGETS: dict[str, dict[str, Any]] = {
    "llama31_8b": {  # meta-llama/Llama-3.1-8B-Instruct
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    },
    "olmo2_7b": {  # allenai/OLMo-2-1124-7B-Instruct
        "architectures": ["Olmo2ForCausalLM"],
        "vocab_size": 100352,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100257,
        "pad_token_id": 100277,
    },
    "qwen3_4b": {  # Qwen/Qwen3-4B
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
    },
}
# the training configs' (data, model) split of 8 chips (configs/llama31_8b.py, qwen3_4b.py; OLMo 2
# 7B has none: as Llama's); a batch the data axis does not divide trains on 1 x 8
TRAIN_MESH = {"llama31_8b": (2, 4), "olmo2_7b": (2, 4), "qwen3_4b": (4, 2)}
DRAFT_VOCAB = 32000  # the published heads' Vd

# HBM per chip, decimal bytes (the vendors' figures; a little less is usable)
DEVICES = {"H100": 80e9, "H200": 141e9, "TPU v5e": 16e9, "TPU v5p": 95e9}

# a chain as deep as the reporting tree (`config.default_tree` with top_k 1)
CHAIN_TREE = TreeConfig(
    top_k=1, depth=ACCELERATOR_TREE.depth, total_tokens=ACCELERATOR_TREE.depth + 1
)
PROGRAMS = ("prefill", "spec_prefill", "decode_step", "round_tree", "round_chain", "train_step")

# custom calls a TPU/GPU program may hold: sharding annotations (no kernel). Anything else in the
# hot path is reported (a host callback, a CPU library kernel, a platform-specific kernel).
ALLOWED_CUSTOM_CALLS = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"}
CALLBACK = re.compile(r"callback|xla_python|py_func", re.I)


def target_config(name: str) -> TargetConfig:
    if name not in REAL_TARGETS:
        raise Eagle3Error(f"unknown target {name!r}: choose one of {', '.join(REAL_TARGETS)}")
    cfg = target_config_from_hf(REAL_TARGETS[name])
    return dataclasses.replace(cfg, products=PLAIN_PRODUCTS)  # accelerators: plain products


def draft_config(tcfg: TargetConfig) -> DraftConfig:
    return DraftConfig.from_target(tcfg, draft_vocab_size=min(DRAFT_VOCAB, tcfg.vocab_size))


# ----------------------------------------------------------------------------- abstract inputs


def _sds(x, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _with_shardings(avals, shardings):
    return jax.tree.map(_sds, avals, shardings)


def abstract_target(tcfg: TargetConfig, mesh: Mesh, dtype=jnp.bfloat16):
    """The target's params as ShapeDtypeStructs laid out as the loaders place them (a list of
    layers, `target.param_shardings`): no weight is allocated."""
    shapes = jax.eval_shape(lambda k: tgt.init_params(tcfg, k, dtype), jax.random.key(0))
    return _with_shardings(shapes, tgt.param_shardings(tcfg, mesh))


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
    """[B, T, G, K] new keys/values (a speculative round's pending path): as the cache."""
    return named(mesh, ("batch", None, "kv_heads", None), x.shape)


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
    """The named program (`PROGRAMS`) of a setup, with abstract, sharded arguments."""
    tcfg = target_config(s.target)
    dcfg = draft_config(tcfg)
    b = s.batch
    if name == "train_step":
        return _train_program(s, tcfg, dcfg)
    mesh = _mesh(s.mesh)
    tparams = abstract_target(tcfg, mesh)
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


# ----------------------------------------------------------------------------- export and checks


@contextlib.contextmanager
def trace_time_work():
    """Records what runs on this machine while the block traces a program: XLA compilations
    (tracing for export compiles nothing, so any is a probe or an eager computation run at trace
    time, which a TPU host would run there too, once per trace) and `jax.default_backend()`
    queries (a program whose shape depends on the exporting machine: here "cpu")."""
    events: list[str] = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append("compile")

    real = jax.default_backend

    def query():
        events.append("default_backend")
        return real()

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.default_backend = query
    try:
        yield events
    finally:
        jax.default_backend = real
        jax.monitoring.unregister_event_duration_listener(listen)


def custom_call_targets(text: str) -> set[str]:
    """Every custom-call target in a StableHLO module's text."""
    found = set(re.findall(r"custom_call\s*@([\w.$]+)", text))
    return found | set(re.findall(r'call_target_name\s*=\s*"([^"]+)"', text))


def shard_bytes(aval, sharding) -> int:
    """Bytes of one device's shard of an array."""
    shape = sharding.shard_shape(aval.shape) if sharding is not None else aval.shape
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


@dataclasses.dataclass
class Report:
    """What one exported program is, and what a TPU or GPU would object to."""

    program: str
    target: str
    batch: int
    mesh: str
    platforms: tuple[str, ...]
    seconds: float
    module_chars: int
    custom_calls: list[str]
    trace_work: list[str]  # compilations and backend queries while tracing (trace_time_work)
    inputs: dict[str, int]  # group -> bytes per device (params, head, state, ...)
    outputs_bytes: int  # bytes per device of the outputs (as their input counterparts are laid out)
    off_dtype: list[str]  # float state/param buffers not in the dtype asked for
    nr_devices: int

    @property
    def problems(self) -> list[str]:
        out = []
        bad = [c for c in self.custom_calls if c not in ALLOWED_CUSTOM_CALLS]
        if bad:
            out.append(f"custom calls {bad}")
        if self.trace_work:
            out.append(f"at trace time: {sorted(set(self.trace_work))}")
        if self.off_dtype:
            out.append(f"dtype: {self.off_dtype[:4]}")
        if tuple(self.platforms) != PLATFORMS:
            out.append(f"platforms {self.platforms}")
        return out


def _path_str(path) -> str:
    return jax.tree_util.keystr(path)


def _off_dtype(prog: Program, exported) -> list[str]:
    """Float leaves of the params, head and state (in and out) whose dtype is not the one asked
    for: an fp32 cache or weight where bf16 was asked doubles its HBM."""
    want = np.dtype(prog.want_dtype)
    bad = []
    skip = {"inputs", "batch", "t2d", "vocab"}
    flat, _ = jax.tree_util.tree_flatten_with_path(prog.args)
    names = []
    for g, n in prog.groups.items():
        names += [g] * n
    for (path, leaf), g in zip(flat, names):
        if g in skip:
            continue
        if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != want:
            bad.append(f"in{_path_str(path)}: {leaf.dtype}")
    if prog.state_arg is not None or prog.name.endswith("prefill"):  # the state it returns
        state_out = jax.tree.leaves(
            jax.tree.unflatten(exported.out_tree, exported.out_avals)[0]
            if prog.name == "train_step"
            else jax.tree.unflatten(exported.out_tree, exported.out_avals)
        )
        for i, a in enumerate(state_out):
            if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype != want:
                bad.append(f"out state leaf {i} {a.shape}: {a.dtype}")
    return bad


def export_program(prog: Program, platforms=PLATFORMS):
    """(jax.export.Exported, Report) of a program for `platforms`."""
    t0 = time.perf_counter()
    with trace_time_work() as compiles:
        exported = export.export(prog.fn, platforms=platforms)(*prog.args, **prog.kwargs)
        text = exported.mlir_module()
    seconds = time.perf_counter() - t0
    # laid out as the caller holds them: an argument the program does not read (the head's
    # lm_head in a prefill) keeps no sharding in the export, but the caller's copy stays sharded
    given = jax.tree.leaves(prog.args)
    if len(given) != len(exported.in_avals):
        raise Eagle3Error(f"{prog.name}: {len(exported.in_avals)} inputs, {len(given)} given")
    per_leaf = [shard_bytes(a, g.sharding) for a, g in zip(exported.in_avals, given)]
    inputs, i = {}, 0
    for g, n in prog.groups.items():
        inputs[g] = sum(per_leaf[i : i + n])
        i += n
    if i != len(per_leaf):
        raise Eagle3Error(f"{prog.name}: {len(per_leaf)} inputs, groups count {i}")
    out_bytes = _outputs_bytes(prog, exported)
    mesh = "x".join(str(x) for x in prog.mesh.devices.shape)
    report = Report(
        prog.name,
        "",
        0,
        mesh,
        tuple(exported.platforms),
        seconds,
        len(text),
        sorted(custom_call_targets(text)),
        list(compiles),
        inputs,
        out_bytes,
        _off_dtype(prog, exported),
        exported.nr_devices,
    )
    if CALLBACK.search(" ".join(report.custom_calls)) or "host_callback" in text:
        report.custom_calls.append("<host callback>")
    return exported, report


def _outputs_bytes(prog: Program, exported) -> int:
    """Bytes per device of the outputs: the state as its input is laid out (donated: it replaces
    the input), the rest replicated (an upper bound for small results)."""
    state_in = None if prog.state_arg is None else prog.args[prog.state_arg]
    outs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    if state_in is not None:
        state_out = outs[0] if prog.name == "train_step" else outs
        if jax.tree.structure(state_out) == jax.tree.structure(state_in):
            rest = jax.tree.leaves(outs[1]) if prog.name == "train_step" else []
            return sum(
                shard_bytes(a, s.sharding)
                for a, s in zip(jax.tree.leaves(state_out), jax.tree.leaves(state_in))
            ) + sum(shard_bytes(a, None) for a in rest)
    if prog.name in ("prefill", "spec_prefill"):  # the state the decode loop then holds
        return sum(shard_bytes(a, None) for a in exported.out_avals if a.size < 2**20) + sum(
            shard_bytes(a, named(prog.mesh, ("batch", "kv_heads", None, None), a.shape))
            for a in exported.out_avals
            if a.size >= 2**20
        )
    return sum(shard_bytes(a, None) for a in exported.out_avals)


# ----------------------------------------------------------------------------- sizes in HBM


def _div(n: int, mesh_axis: int) -> int:
    """How many ways a dimension of size n is split over a mesh axis (1 where it does not divide,
    as `sharding.spec_for` replicates it)."""
    return mesh_axis if n % mesh_axis == 0 else 1


@dataclasses.dataclass
class Memory:
    """Bytes per device of one program at one setup (decimal GB in `row`)."""

    params: int  # target weights (+ head, embedding shared) as laid out
    kv_cache: int  # target + draft caches (decoding) or 0
    state: int  # everything else the program holds across calls (opt state, token buffers)
    activations: int  # the largest transient working set, counted from shapes

    @property
    def total(self) -> int:
        return self.params + self.kv_cache + self.state + self.activations

    def fits(self) -> dict[str, bool]:
        return {d: self.total <= cap for d, cap in DEVICES.items()}


def verify_activations(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, nodes: int, slots: int, mesh
) -> int:
    """A verification of `nodes` tokens per row, per device, from shapes: the fp32 logits
    [B, N, V] (vocab over model), every layer's new K/V [B, N, G, K] (held until the path is
    chosen), the aux features [B, N, 3D], and one layer's largest transients (fp32 scores and
    probabilities [B, H, N, S + N], the MLP's gate/up/product [B, N, F])."""
    data, model = mesh
    b = batch // _div(batch, data)
    v = tcfg.vocab_size // _div(tcfg.vocab_size, model)
    g = tcfg.num_kv_heads // _div(tcfg.num_kv_heads, model)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    f = tcfg.intermediate_size // _div(tcfg.intermediate_size, model)
    logits = b * nodes * v * 4
    new_kv = tcfg.num_layers * 2 * b * nodes * g * tcfg.head_dim * 2
    aux = b * nodes * dcfg.feature_size * 2
    layer = 2 * b * h * nodes * (slots + nodes) * 4 + 3 * b * nodes * f * 2
    return logits + new_kv + aux + layer


def prefill_activations(tcfg: TargetConfig, batch: int, t: int, slots: int, mesh) -> int:
    """A prefill of t tokens per row, per device: the residual stream and aux features [B, T, D]
    and one layer's transients (scores and probabilities [B, H, T, S]: p.V is bf16 above 64
    queries, so fp32 scores and bf16 probabilities; the MLP [B, T, F] x 3)."""
    data, model = mesh
    b = batch // _div(batch, data)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    f = tcfg.intermediate_size // _div(tcfg.intermediate_size, model)
    stream = b * t * tcfg.hidden_size * 2 * 5  # residual, normed, attention out, aux x 3 (bf16)
    layer = b * h * t * slots * (4 + 2) + 3 * b * t * f * 2
    return stream + layer


def train_activations(
    tcfg: TargetConfig, dcfg: DraftConfig, batch: int, t: int, steps: int, mesh
) -> int:
    """A TTT step, per device: the target's fp32 logits [B, T, V] (the teacher), its aux features,
    one target layer's transients, and per TTT step what the backward keeps without remat: the
    step-0 block's scores and probabilities [B, H, T, T] (fp32 + bf16), the draft logits and
    log-softmax [B, T, Vd] fp32, the MLP [B, T, F] x 3, the layer's inputs [B, T, 2D]."""
    data, model = mesh
    b = batch // _div(batch, data)
    v = tcfg.vocab_size // _div(tcfg.vocab_size, model)
    h = tcfg.num_heads // _div(tcfg.num_heads, model)
    dh = dcfg.num_heads // _div(dcfg.num_heads, model)
    f = tcfg.intermediate_size // _div(tcfg.intermediate_size, model)
    vd = dcfg.draft_vocab_size // _div(dcfg.draft_vocab_size, model)
    teacher = b * t * v * 4 + b * t * dcfg.feature_size * 2
    target_layer = b * h * t * t * (4 + 2) + 3 * b * t * f * 2
    per_step = b * dh * t * t * (4 + 2) + 2 * b * t * vd * 4 + 3 * b * t * f * 2
    per_step += b * t * 2 * dcfg.hidden_size * 2 * 2
    return teacher + max(target_layer, steps * per_step)


def memory(prog: Program, report: Report, s: Setup) -> Memory:
    """A program's bytes per device: inputs from the exported avals and shardings, activations
    counted from shapes."""
    tcfg = target_config(s.target)
    dcfg = draft_config(tcfg)
    params = sum(report.inputs.get(g, 0) for g in ("params", "head", "vocab"))
    if prog.name == "train_step":
        acts = train_activations(tcfg, dcfg, s.batch, s.train_len, s.ttt_steps, s.train_mesh)
        # the head's state and its gradients (one more copy of the params), plus the batch
        st = report.inputs["state"]
        grads = sum(shard_bytes(a, a.sharding) for a in jax.tree.leaves(prog.args[0].params))
        return Memory(params, 0, st + grads + report.inputs["batch"], acts)
    shape = prog.kwargs["shape"]
    if prog.name in ("prefill", "spec_prefill"):
        state = report.outputs_bytes
        kv = _cache_bytes_out(prog, s, tcfg, dcfg, shape)
        acts = prefill_activations(tcfg, s.batch, shape.prompt_len, shape.slots, s.mesh)
        return Memory(params, kv, max(state - kv, 0), acts)
    st = prog.args[prog.state_arg]
    cache = st.cache if prog.name == "decode_step" else (st.tcache, st.dcache)
    kv = sum(shard_bytes(a, a.sharding) for a in jax.tree.leaves(cache))
    rest = report.inputs["state"] - kv
    if prog.name == "decode_step":
        acts = verify_activations(tcfg, dcfg, s.batch, 1, shape.slots, s.mesh)
    else:
        tree = prog.kwargs["tree"]
        acts = verify_activations(tcfg, dcfg, s.batch, tree.total_tokens, shape.slots, s.mesh)
    return Memory(params, kv, rest, acts)


def _cache_bytes_out(prog, s, tcfg, dcfg, shape) -> int:
    mesh = prog.mesh
    ks, vs = tgt.kv_shapes(s.batch, shape.slots, tcfg.num_kv_heads, tcfg.head_dim)
    sh = tgt.cache_sharding(tcfg, mesh, s.batch)["k"][0]
    kv = tcfg.num_layers * sum(
        shard_bytes(jax.ShapeDtypeStruct(x, jnp.bfloat16), sh) for x in (ks, vs)
    )
    if prog.name == "spec_prefill":
        dslots = shape.slots + prog.kwargs["tree"].tree_slots
        ks, vs = tgt.kv_shapes(s.batch, dslots, dcfg.num_kv_heads, dcfg.head_dim)
        dsh = drf.cache_sharding(dcfg, mesh, s.batch)["k"]
        kv += sum(shard_bytes(jax.ShapeDtypeStruct(x, jnp.bfloat16), dsh) for x in (ks, vs))
    return kv


# ----------------------------------------------------------------------------- one row


def run(name: str, s: Setup, platforms=PLATFORMS) -> tuple[Report, Memory]:
    """Builds, exports and sizes one program: (Report, Memory)."""
    prog = build(name, s)
    _, report = export_program(prog, platforms)
    report.target, report.batch = s.target, s.batch
    return report, memory(prog, report, s)


def row(report: Report, mem: Memory) -> dict[str, Any]:
    """A JSON-ready record of one export."""
    gb = lambda x: round(x / 1e9, 3)  # noqa: E731
    return {
        "target": report.target,
        "program": report.program,
        "batch": report.batch,
        "mesh": report.mesh,
        "platforms": list(report.platforms),
        "export_s": round(report.seconds, 2),
        "module_chars": report.module_chars,
        "custom_calls": report.custom_calls,
        "problems": report.problems,
        "gb_per_device": {
            "params": gb(mem.params),
            "kv_cache": gb(mem.kv_cache),
            "state": gb(mem.state),
            "activations": gb(mem.activations),
            "total": gb(mem.total),
        },
        "fits": mem.fits(),
    }


__all__ = [
    "CHAIN_TREE",
    "DEVICES",
    "PLATFORMS",
    "PROGRAMS",
    "REAL_TARGETS",
    "Memory",
    "Program",
    "Report",
    "Setup",
    "build",
    "export_program",
    "memory",
    "row",
    "run",
]

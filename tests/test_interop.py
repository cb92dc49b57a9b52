"""Every EAGLE-3 runtime loads our heads as our engine runs them.

Each `*_rule` below re-implements one runtime's loading rule (docs/interop.md cites the source file
and line of every step) as a small function over a head directory: which embedding the draft ends
up with, which target layers it reads (as hidden_states indices: the inputs to those layers) and
which target token each draft id becomes. `agree` asserts that every rule ends where
`load_draft` does. The rules are kept literal, silent failures included (the official code's
strict=False load, vLLM's missing-tensor blindness), since those are what a wrong export hits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3_jax import vocab as vocab_lib
from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
from eagle3_jax.checkpoints.safetensors_io import read_safetensors
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf

SHIPPED = Path(__file__).resolve().parents[1] / "eagle3_jax" / "heads" / "smollm2_135m_instruct"
SMOLLM2_LAYERS = 30  # SmolLM2-135M-Instruct's num_hidden_layers

_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "hidden_norm", "input_layernorm",
          "post_attention_layernorm")  # fmt: skip
MODULE = ["fc.weight", "norm.weight", "lm_head.weight"] + [f"midlayer.{n}.weight" for n in _LAYER]


@dataclasses.dataclass
class Loaded:
    embed: str  # "target", "head" (the file's own) or "random" (left at its initialisation)
    aux: tuple[int, ...]  # target hidden_states indices the head reads, ascending
    tokens: np.ndarray  # target token of each draft id
    missing: list[str]  # module tensors the file did not fill


def _files(head: Path) -> tuple[dict, dict]:
    hf = json.loads((head / "config.json").read_text())
    return hf, read_safetensors(head / "model.safetensors")


def _default(n_layers: int) -> tuple[int, ...]:
    return (2, n_layers // 2, n_layers - 3)


def _tokens(vd: int, v: int, d2t) -> np.ndarray:
    if vd == v:
        return np.arange(v)
    d2t = np.zeros(vd, np.int64) if d2t is None else np.asarray(d2t)
    return np.arange(vd) + d2t


def official_rule(head: Path, n_layers: int) -> Loaded:
    """SafeAILab/EAGLE cb7e084: eagle/model/ea_model.py 48-76, eagle/model/cnets.py 479-544."""
    hf, t = _files(head)
    v, vd = hf["vocab_size"], hf["draft_vocab_size"]  # EConfig has no draft_vocab_size default
    # cnets.py 488: the target's embedding is read only when the config has NO target_hidden_size
    embed = "random" if "target_hidden_size" in hf else "target"
    if "embed_tokens.weight" in t:  # ea_model.py 76: load_state_dict after, strict=False
        embed = "head"
    missing = [n for n in MODULE if n not in t]  # strict=False: never checked
    aux = _default(n_layers)  # modeling_llama_kv.py 1137-1139: hard-coded, config ignored
    return Loaded(embed, aux, _tokens(vd, v, t.get("d2t")), missing)


def specforge_rule(head: Path, n_layers: int) -> Loaded:
    """sgl-project/SpecForge a6b6b02: modeling/draft/llama3_eagle.py 1654-1800,
    algorithms/model_providers.py 188-211 (ids = layer outputs, captured by SGLang at +1)."""
    hf, t = _files(head)
    v, vd = hf["vocab_size"], hf.get("draft_vocab_size") or hf["vocab_size"]
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = ids if ids is not None else [1, n_layers // 2 - 1, n_layers - 4]
    embed = "head" if "embed_tokens.weight" in t else "target"  # frozen copy of the target's
    missing = [n for n in MODULE if n not in t]
    return Loaded(embed, tuple(sorted(i + 1 for i in ids)), _tokens(vd, v, t.get("d2t")), missing)


def sglang_rule(head: Path, n_layers: int) -> Loaded:
    """sglang 0.5.23: srt/models/llama_eagle3.py 325-378, srt/models/llama.py 910-941,
    srt/speculative/eagle_worker_v2.py 356-363."""
    hf, t = _files(head)
    assert "LlamaForCausalLMEagle3" in hf["architectures"]
    v, vd = hf["vocab_size"], hf.get("draft_vocab_size")
    names = {n.replace("midlayer", "layers.0") for n in t}  # legacy_name_map; unknown skipped
    missing = [n for n in MODULE if n.replace("midlayer", "layers.0") not in names]
    # set_embed: the target's, unless target_hidden_size is set AND differs from hidden_size
    own = hf.get("target_hidden_size") not in (None, hf["hidden_size"])
    embed = ("head" if "embed_tokens.weight" in t else "random") if own else "target"
    ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(i + 1 for i in ids) if ids is not None else _default(n_layers)
    if vd is None:  # no draft vocabulary: the target's lm_head
        return Loaded(embed, tuple(sorted(aux)), np.arange(v), missing)
    d2t = t.get("d2t")
    tokens = np.arange(vd) if d2t is None else np.asarray(d2t) + np.arange(vd)  # hot_token_id
    return Loaded(embed, tuple(sorted(aux)), tokens, missing)


def vllm_rule(head: Path, n_layers: int, target_embed: np.ndarray) -> Loaded:
    """vllm 0.34.0: model_executor/models/llama_eagle3.py 101-448, v1/worker/gpu/spec_decode/
    eagle/eagle3_utils.py 103-140, eagle/utils.py 20-115, configs/speculators/algos.py 15-50."""
    hf, t = _files(head)
    if "speculators_model_type" in hf:  # the speculators adapter
        layer = hf["transformer_layer_config"]
        v, hidden = layer["vocab_size"], layer["hidden_size"]
        assert hf.get("norm_before_residual", True) is False  # absent reads as TRUE here
        names = set(t)
    else:
        assert set(hf["architectures"]) & {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}
        v, hidden = hf["vocab_size"], hf["hidden_size"]
        assert not hf.get("norm_before_residual", False)
        names = {n.replace("midlayer.", "layers.0.") for n in t}  # hf_to_vllm_mapper
    vd = hf.get("draft_vocab_size") or v
    if vd == v and "d2t" in t:  # draft_id_to_target_id has no parameter to load into
        raise ValueError("unexpected tensor d2t")
    missing = [n for n in MODULE if n.replace("midlayer.", "layers.0.") not in names]
    own = "embed_tokens.weight" in t and not np.array_equal(t["embed_tokens.weight"], target_embed)
    embed = "head" if own else "target"
    assert hf.get("target_hidden_size") in (None, hidden) or own or "embed_tokens.weight" in t
    ids = hf.get("eagle_aux_hidden_state_layer_ids")  # top level only, used as they are
    aux = tuple(sorted(set(ids))) if ids is not None else _default(n_layers)
    return Loaded(embed, aux, _tokens(vd, v, t.get("d2t")), missing)


def speculators_rule(head: Path, n_layers: int) -> Loaded:
    """vllm-project/speculators c05b95b: models/eagle3/config.py 27-87, core.py 31-171,
    model.py 48-177 (a missing embedding is filled from the verifier)."""
    hf, t = _files(head)
    assert hf["speculators_model_type"] == "eagle3"
    layer = hf["transformer_layer_config"]
    v, vd = layer["vocab_size"], hf["draft_vocab_size"]
    missing = [n for n in MODULE if n.replace("midlayer.", "layers.0.") not in t]
    embed = "head" if "embed_tokens.weight" in t else "target"
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(ids) if ids is not None else _default(n_layers)
    return Loaded(embed, aux, _tokens(vd, v, t.get("d2t")), missing)


def ours(head: Path, tcfg) -> Loaded:
    _, cfg, vocab, embed = load_draft(head, tcfg)
    tokens = np.asarray(vocab_lib.target_ids(vocab))
    return Loaded("head" if embed is not None else "target", cfg.aux_layer_ids, tokens, [])


def agree(head: Path, tcfg, target_embed, rules=("official", "specforge", "sglang", "vllm"),
          hard_coded_ok: bool = True) -> None:  # fmt: skip
    want = ours(head, tcfg)
    n = tcfg.num_layers
    got = {
        "official": lambda: official_rule(head, n),
        "specforge": lambda: specforge_rule(head, n),
        "sglang": lambda: sglang_rule(head, n),
        "vllm": lambda: vllm_rule(head, n, target_embed),
        "speculators": lambda: speculators_rule(head, n),
    }
    for name in rules:
        r = got[name]()
        assert r.missing == [], (name, r.missing)
        assert r.embed == want.embed, (name, r.embed, want.embed)
        if name != "official" or want.aux == _default(n) or not hard_coded_ok:
            assert r.aux == want.aux, (name, r.aux, want.aux)
        np.testing.assert_array_equal(r.tokens, want.tokens, err_msg=name)


@pytest.fixture(scope="module")
def tcfg(tiny_target_dir):
    from eagle3_jax.checkpoints import load_target_config

    return dataclasses.replace(load_target_config(str(tiny_target_dir)), num_layers=12)


def _head(tcfg, vd=None, aux=None, width=None, seed=0):
    over = {}
    if vd:
        over["draft_vocab_size"] = vd
    if aux:
        over["aux_layer_ids"] = aux
    if width:
        over.update(hidden_size=width, intermediate_size=2 * width, num_heads=2, num_kv_heads=1,
                    head_dim=width // 2)  # fmt: skip
    cfg = drf.DraftConfig.from_target(tcfg, **over)
    params = drf.init_params(cfg, jax.random.PRNGKey(seed), scale=0.1)
    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
    vocab = vocab_lib.from_target_ids(ids, cfg.vocab_size)
    embed = rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32) if width else None
    return params, cfg, vocab, embed


TARGET_EMBED = np.zeros((97, 64), np.float32)  # stands for the target's; heads' own differ


@pytest.mark.parametrize(
    "vd, aux, width",
    [(None, None, None), (40, None, None), (40, (1, 5, 7, 10), None), (40, None, 32)],
    ids=["full-vocab", "reduced", "four-layers", "narrower-head"],
)
def test_every_runtime_loads_our_export_as_we_run_it(tcfg, tmp_path, vd, aux, width):
    params, cfg, vocab, embed = _head(tcfg, vd, aux, width)
    save_draft(tmp_path / "h", params, cfg, vocab, "float32", embed)
    agree(tmp_path / "h", tcfg, TARGET_EMBED)


def test_the_rules_catch_the_old_export(tcfg, tmp_path):
    """Until 2026-12-03 config.json always carried target_hidden_size: the official loader then
    keeps a random embedding (the cause of tau 1.64 against our 2.90, docs/interop.md), and a
    non-default layer set reached vLLM only through the nested key, which vLLM does not read."""
    params, cfg, vocab, embed = _head(tcfg, 40)
    save_draft(tmp_path / "h", params, cfg, vocab, "float32", embed)
    hf = json.loads((tmp_path / "h/config.json").read_text())
    hf["target_hidden_size"] = hf["hidden_size"]
    (tmp_path / "h/config.json").write_text(json.dumps(hf))
    assert official_rule(tmp_path / "h", tcfg.num_layers).embed == "random"
    with pytest.raises(AssertionError, match="official"):
        agree(tmp_path / "h", tcfg, TARGET_EMBED)
    params, cfg, vocab, embed = _head(tcfg, 40, (1, 5, 7))
    save_draft(tmp_path / "g", params, cfg, vocab, "float32", embed)
    hf = json.loads((tmp_path / "g/config.json").read_text())
    del hf["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "g/config.json").write_text(json.dumps(hf))
    with pytest.raises(AssertionError, match="vllm"):
        agree(tmp_path / "g", tcfg, TARGET_EMBED)


def test_the_shipped_head_loads_alike_everywhere():
    from eagle3_jax.config import TargetConfig

    hf = json.loads((SHIPPED / "config.json").read_text())
    assert "target_hidden_size" not in hf
    tcfg = dataclasses.replace(
        _smollm2_like(TargetConfig), num_layers=SMOLLM2_LAYERS, vocab_size=hf["vocab_size"]
    )
    agree(SHIPPED, tcfg, TARGET_EMBED, hard_coded_ok=False)
    assert ours(SHIPPED, tcfg).aux == (2, 15, 27)


def _smollm2_like(cls):
    from eagle3_jax.checkpoints.head_config import draft_config_from_hf

    hf = json.loads((SHIPPED / "config.json").read_text())
    d = draft_config_from_hf(hf)
    fields = {f.name for f in dataclasses.fields(cls)}
    base = dict(
        family="llama", hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_heads=d.num_heads, num_kv_heads=d.num_kv_heads, head_dim=d.head_dim,
        vocab_size=d.vocab_size, num_layers=SMOLLM2_LAYERS, rms_norm_eps=d.rms_norm_eps,
    )  # fmt: skip
    return cls(**{k: v for k, v in base.items() if k in fields})


def test_speculators_layout_round_trips_and_loads_in_vllm(tcfg, tiny_target_dir, tmp_path):
    from eagle3_jax.cli.export import main

    params, cfg, vocab, _ = _head(tcfg, 40, (1, 5, 7))
    save_draft(tmp_path / "h", params, cfg, vocab, "float32")
    small = tmp_path / "small"  # the tiny target itself, at 12 layers so the ids exist
    small.mkdir()
    for f in tiny_target_dir.iterdir():
        (small / f.name).symlink_to(f)
    (small / "config.json").unlink()
    hf = json.loads((tiny_target_dir / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 12}))
    base = ["--target", str(small), "--dtype", "float32"]
    spec = tmp_path / "spec"
    assert main(["--draft", str(tmp_path / "h"), "--out", str(spec), "--layout", "speculators",
                 "--verifier", "org/tiny", *base]) == 0  # fmt: skip
    hf = json.loads((spec / "config.json").read_text())
    assert hf["architectures"] == ["Eagle3Speculator"] and hf["norm_before_residual"] is False
    assert hf["speculators_config"]["verifier"] == {
        "name_or_path": "org/tiny",
        "architectures": ["LlamaForCausalLM"],
    }
    names = set(read_safetensors(spec / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in names and not any("midlayer" in n for n in names)
    agree(spec, tcfg, TARGET_EMBED, rules=("vllm", "speculators"))
    # back to the official layout: the same tensors, byte for byte, and the same config
    back = tmp_path / "back"
    assert main(["--draft", str(spec), "--out", str(back), *base]) == 0
    a, b = (
        read_safetensors(tmp_path / "h/model.safetensors"),
        read_safetensors(back / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (tmp_path / "h/config.json").read_text()
    )
    assert main(["--draft", str(spec), "--out", str(back), *base]) == 2  # exists: --overwrite
    assert main(["--draft", str(spec), "--out", str(back), "--overwrite", *base]) == 0


def test_a_specforge_head_with_its_frozen_embedding_and_identity_map_loads(tcfg, tmp_path):
    """SpecForge saves embed_tokens.weight (a frozen copy of the target's) and d2t/t2d buffers even
    at the full vocabulary (d2t zeros, t2d all ones): the head's own embedding is used, as the
    official loader does, and the map is the identity."""
    from eagle3_jax.checkpoints.safetensors_io import write_safetensors

    params, cfg, vocab, _ = _head(tcfg)
    save_draft(tmp_path / "h", params, cfg, vocab, "float32")
    t = read_safetensors(tmp_path / "h/model.safetensors")
    emb = np.random.default_rng(1).normal(size=(cfg.vocab_size, cfg.hidden_size))
    t["embed_tokens.weight"] = emb.astype(np.float32)
    t["d2t"] = np.zeros(cfg.vocab_size, np.int64)
    t["t2d"] = np.ones(cfg.vocab_size, np.bool_)
    sf = tmp_path / "sf"
    sf.mkdir()
    write_safetensors(sf / "model.safetensors", t)
    hf = json.loads((tmp_path / "h/config.json").read_text())
    del hf["eagle_aux_hidden_state_layer_ids"]  # SpecForge writes only the nested key
    (sf / "config.json").write_text(json.dumps(hf))
    _, _, v2, e2 = load_draft(sf, tcfg)
    np.testing.assert_array_equal(vocab_lib.target_ids(v2), np.arange(cfg.vocab_size))
    np.testing.assert_array_equal(np.asarray(e2), t["embed_tokens.weight"])
    agree(sf, tcfg, TARGET_EMBED, rules=("official", "specforge"))


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda h: h.pop("norm_before_residual"), "lacks norm_before_residual"),
        (lambda h: h.update(norm_output=True), "norm_output=true"),
        (lambda h: h["transformer_layer_config"].update(model_type="qwen3"), "'qwen3' decoder"),
        (lambda h: h.update(eagle_aux_hidden_state_layer_ids=[-1, 3]), "negative id"),
    ],
    ids=["no-norm_before_residual", "normed-feedback", "qwen3-layer", "negative-id"],
)
def test_layouts_we_cannot_run_are_refused_in_one_line(tcfg, tmp_path, edit, msg):
    from eagle3_jax.checkpoints import layouts

    params, cfg, vocab, _ = _head(tcfg, 40)
    save_draft(tmp_path / "h", params, cfg, vocab, "float32", layout=layouts.SPECULATORS,
               verifier=("org/tiny", ["LlamaForCausalLM"]))  # fmt: skip
    hf = json.loads((tmp_path / "h/config.json").read_text())
    edit(hf)
    (tmp_path / "h/config.json").write_text(json.dumps(hf))
    with pytest.raises(Eagle3Error, match=msg):
        load_draft(tmp_path / "h", tcfg)


def test_conflicting_layer_keys_and_extra_layers_are_refused(tcfg, tmp_path):
    from eagle3_jax.checkpoints.safetensors_io import write_safetensors

    params, cfg, vocab, _ = _head(tcfg, 40)
    save_draft(tmp_path / "h", params, cfg, vocab, "float32")
    hf = json.loads((tmp_path / "h/config.json").read_text())
    hf["eagle_aux_hidden_state_layer_ids"] = list(
        hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    (tmp_path / "h/config.json").write_text(json.dumps(hf))
    with pytest.raises(Eagle3Error, match="differ by exactly 1"):
        load_draft(tmp_path / "h", tcfg)
    del hf["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "h/config.json").write_text(json.dumps(hf))
    t = read_safetensors(tmp_path / "h/model.safetensors")
    t["layers.1.mlp.up_proj.weight"] = t["midlayer.mlp.up_proj.weight"]
    write_safetensors(tmp_path / "h/model.safetensors", t)
    with pytest.raises(Eagle3Error, match="decoder layer 1"):
        load_draft(tmp_path / "h", tcfg)

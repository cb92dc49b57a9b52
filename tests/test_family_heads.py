"""EAGLE-3 heads on the mixture-of-experts (Qwen3-MoE, Mixtral, OLMoE), Gemma 3 and gpt-oss
targets (issue 61): a head trains on a sharp tiny target of each family (online features, the
head sized from the target: TTT loss falls, held-out acc_0 rises); a head made for each
round-trips through the official and speculators layouts with its target's family recorded, and
one made for another family, hidden size or vocabulary is refused naming both.

The training test runs one family in the default suite (gpt-oss, the one furthest from Llama:
sinks, YaRN, biases, the clamped SwiGLU); the other four are marked slow."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import write_tiny_tokenizer

from eagle3_jax.checkpoints import layouts
from eagle3_jax.checkpoints.eagle_format import load_draft, save_draft
from eagle3_jax.checkpoints.head_config import draft_config_from_hf, draft_config_to_hf
from eagle3_jax.config import target_config_from_hf
from eagle3_jax.errors import Eagle3Error
from eagle3_jax.models import draft as drf
from eagle3_jax.models import target as tgt
from eagle3_jax.vocab import from_target_ids, identity

BASE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
# each family's transformers config, tiny (4 layers: aux ids (1, 2))
CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    )),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2,
    )),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
    )),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, swiglu_limit=1.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "beta_fast": 16.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
    )),
}  # fmt: skip


def _hf_config(family: str) -> dict:
    cls, arch, extra = CONFIGS[family]
    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    return {**BASE, **extra, "architectures": [arch], "model_type": model_type}


def _sharp_target(family: str, directory):
    """A tiny transformers model of `family` whose next token is sharp and mostly a function of
    the current one (embedding and output rows of unit spread, the layers' weights small): what
    a head can learn from a dozen conversations and carry to held-out ones. Saved with a
    tokenizer."""
    import transformers

    cls, arch, extra = CONFIGS[family]
    config = getattr(transformers, cls)(**{**BASE, **extra})
    torch.manual_seed(1)
    model = getattr(transformers, arch)(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms are x * (1 + w): around 0
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.2 * torch.randn_like(p))
            else:
                big = any(k in name for k in ("sinks", "embed_tokens", "lm_head"))
                p.copy_((1.0 if big else 0.03) * torch.randn_like(p))
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def _conversations(path, n: int, seed: int):
    rng = np.random.default_rng(seed)
    recs = [
        {"id": f"c{seed}_{i}", "conversations": [
            {"from": "human", "value": " ".join(f"w{x}" for x in rng.integers(3, 97, 6))},
            {"from": "gpt", "value": " ".join(f"w{x}" for x in rng.integers(3, 97, 14))},
        ]}
        for i in range(n)
    ]  # fmt: skip
    path.write_text(json.dumps(recs))
    return path


def _slow_unless(family: str, default: str = "gpt_oss"):
    return pytest.param(family, marks=() if family == default else pytest.mark.slow)


@pytest.mark.parametrize("family", [_slow_unless(f) for f in CONFIGS])
def test_a_head_trains_on_each_family(family, tmp_path):
    from pathlib import Path

    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.loop import train

    target = _sharp_target(family, tmp_path / "target")
    tc = load_config(
        Path(__file__).resolve().parents[1] / "configs/tiny.py",
        [
            f"--config.target={target}",
            f"--config.data={_conversations(tmp_path / 'data.json', 12, 0)}",
            f"--config.out_dir={tmp_path / 'run'}",
            f"--config.val_data={_conversations(tmp_path / 'held.json', 6, 7)}",
            "--config.val_every=10", "--config.max_steps=100", "--config.lr=1e-2",
            "--config.log_every=10", "--config.save_every=100", "--config.ttt_steps=2",
            "--config.draft_vocab_size=97",
        ],
    )  # fmt: skip
    summary = train(tc, progress=False)
    logs = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    vals = [json.loads(x) for x in (tmp_path / "run/validation.jsonl").read_text().splitlines()]
    losses, held = [r["loss"] for r in logs], [v["val_acc_0"] for v in vals]
    print(family, "loss", np.round(losses, 3), "held-out acc_0", np.round(held, 3))
    assert losses[-1] < 0.5 * losses[0], losses
    assert held[-1] > held[0] + 0.1, held
    # the exported head records its target's family and loads onto it
    hf = json.loads((Path(summary["head"]) / "config.json").read_text())
    tcfg = target_config_from_hf(json.loads((target / "config.json").read_text()))
    assert hf["target_model_type"] == _hf_config(family)["model_type"]
    _, dcfg, _, _ = load_draft(summary["head"], tcfg)
    assert dcfg.target_family == family


def test_training_runs_a_routed_targets_experts_as_the_backend_does(tmp_path, monkeypatch):
    """Training's target forward, in the step and in the feature store, takes the backend's
    routed dispatch (`backends.routed_as_wanted`) on the training mesh: here the environment's
    ragged on a 1 x 2 mesh splitting Qwen3-MoE's 4 experts (each device on its own 2), where it
    used to run every expert on every token whatever the backend; the store's features equal
    the dense dispatch's."""
    from pathlib import Path
    from types import SimpleNamespace

    from eagle3_jax import backends
    from eagle3_jax.checkpoints import load_target
    from eagle3_jax.training import features, loop
    from eagle3_jax.training.config import load_config
    from eagle3_jax.training.step import target_features

    monkeypatch.setenv(backends.MOE_DISPATCH_ENV, "ragged")
    target = _sharp_target("qwen3_moe", tmp_path / "target")
    tc = load_config(
        Path(__file__).resolve().parents[1] / "configs/tiny.py",
        [
            f"--config.target={target}",
            f"--config.data={_conversations(tmp_path / 'data.json', 4, 0)}",
            f"--config.out_dir={tmp_path / 'run'}", "--config.max_steps=2",
            "--config.mesh_model=2", "--config.draft_vocab_size=97",
        ],
    )  # fmt: skip
    seen = []

    def spy(tcfg, *args, **kwargs):
        seen.append(tcfg)
        raise KeyboardInterrupt  # enough: the step's config is what this test reads

    monkeypatch.setattr(loop, "jit_train_step", spy)
    with pytest.raises(KeyboardInterrupt):
        loop.train(tc, progress=False)
    (step_cfg,) = seen
    assert step_cfg.moe_dispatch == "ragged" and dict(step_cfg.moe_mesh.shape) == {
        "data": 1,
        "model": 2,
    }
    assert tgt.moe_split(step_cfg, 2) == (1, 2)
    monkeypatch.undo()
    monkeypatch.setenv(backends.MOE_DISPATCH_ENV, "ragged")
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 97, (4, 16)).astype(np.int32)
    ds = SimpleNamespace(input_ids=ids, lengths=np.full(4, 16), num_records=4)
    loaded = load_target(str(target))
    got = []

    def recording(tparams, ids_BT, mask_BT, tcfg, aux_ids):
        got.append(tcfg)
        return target_features(tparams, ids_BT, mask_BT, tcfg, aux_ids)

    monkeypatch.setattr(features, "target_features", recording)
    store = features.precompute(loaded, ds, (1, 2), tmp_path / "f", 2, False, 4)
    assert {c.moe_dispatch for c in got} == {"ragged"}
    aux = features.OfflineFeatures(store, ds, (1, 2)).batch(np.arange(4))["aux"]
    dense, _ = target_features(loaded.params, jnp.asarray(ids), jnp.ones((4, 16), jnp.int32),
                               loaded.cfg, (1, 2))  # fmt: skip
    np.testing.assert_allclose(np.asarray(aux), np.asarray(dense), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_head_for_each_family_round_trips_and_is_refused_elsewhere(family, tmp_path):
    tcfg = target_config_from_hf(_hf_config(family))
    dcfg = drf.DraftConfig.from_target(tcfg, draft_vocab_size=40)
    assert dcfg.target_family == family and dcfg.aux_layer_ids == (1, 2)
    if family == "gpt_oss":  # SpecForge's gpt-oss heads: a dense MLP 6 x hidden_size wide
        assert dcfg.intermediate_size == 6 * tcfg.hidden_size
    elif family == "olmoe":  # its k experts' width together (intermediate_size is one expert's)
        assert dcfg.intermediate_size == tcfg.num_experts_per_tok * tcfg.intermediate_size == 64
    else:
        assert dcfg.intermediate_size == tcfg.intermediate_size
    params = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.1)
    ids = np.sort(np.random.default_rng(0).choice(97, 40, replace=False))
    vocab = from_target_ids(ids, 97)
    save_draft(tmp_path / "h", params, dcfg, vocab, "float32")
    hf = json.loads((tmp_path / "h/config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLMEagle3"] and hf["model_type"] == "llama"
    assert hf["target_model_type"] == _hf_config(family)["model_type"]
    assert hf["target_architectures"] == _hf_config(family)["architectures"]
    # aux ids: layer OUTPUTS in eagle_config (SpecForge, SGLang), hidden_states indices on top
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    assert hf["eagle_aux_hidden_state_layer_ids"] == [1, 2]
    got, cfg, got_vocab, _ = load_draft(tmp_path / "h", tcfg)
    assert cfg == dcfg and cfg.target_family == family
    jax.tree.map(np.testing.assert_array_equal, got, params)
    np.testing.assert_array_equal(np.asarray(got_vocab.d2t), np.asarray(vocab.d2t))
    # vLLM's speculators layout names the verifier's architecture: the family survives it
    save_draft(tmp_path / "s", params, dcfg, vocab, "float32", layout=layouts.SPECULATORS,
               verifier=("org/tiny", _hf_config(family)["architectures"]))  # fmt: skip
    _, scfg, _, _ = load_draft(tmp_path / "s", tcfg)
    assert scfg == dcfg and scfg.target_family == family
    assert draft_config_to_hf(scfg) == hf | {"torch_dtype": "bfloat16"}

    # a head for another family: refused naming both
    other = "qwen3_moe" if family != "qwen3_moe" else "gpt_oss"
    ocfg = target_config_from_hf(_hf_config(other))
    with pytest.raises(Eagle3Error, match=rf"made for a {family} target.*this target is {other}"):
        load_draft(tmp_path / "h", ocfg)
    # the same family at another width or vocabulary: refused naming both sizes
    import dataclasses

    wide = dataclasses.replace(tcfg, hidden_size=128)
    with pytest.raises(Eagle3Error, match="target_hidden_size 64 != the target's hidden size 128"):
        load_draft(tmp_path / "h", wide)
    big = dataclasses.replace(tcfg, vocab_size=101)
    with pytest.raises(Eagle3Error, match="vocab_size 97 != the target's vocab size 101"):
        load_draft(tmp_path / "h", big)


def test_published_heads_name_their_target_in_several_ways():
    base = draft_config_to_hf(
        drf.DraftConfig.from_target(target_config_from_hf(_hf_config("qwen3_moe")))
    )
    plain = {k: v for k, v in base.items() if not k.startswith("target_")}
    assert draft_config_from_hf(plain).target_family is None  # model_type llama: the head's own
    # SpecForge's gpt-oss heads put the target's model_type in the head's own
    assert draft_config_from_hf({**plain, "model_type": "gpt_oss"}).target_family == "gpt_oss"
    # SpecForge's Gemma 3 heads: target_model_type
    got = draft_config_from_hf({**plain, "target_model_type": "gemma3_text"})
    assert got.target_family == "gemma3"
    got = draft_config_from_hf(
        {**plain, "target_architectures": ["Gemma3ForConditionalGeneration"]}
    )
    assert got.target_family == "gemma3"
    # a family we do not run is kept by its name, and refused on any target
    deep = draft_config_from_hf({**plain, "target_model_type": "deepseek_v3"})
    assert deep.target_family == "deepseek_v3"
    from eagle3_jax.checkpoints.eagle_format import check_compatible

    tcfg = target_config_from_hf(_hf_config("qwen3_moe"))
    with pytest.raises(
        Eagle3Error, match="made for a deepseek_v3 target.*this target is qwen3_moe"
    ):
        check_compatible(deep, identity(97), tcfg)
    check_compatible(draft_config_from_hf(base), identity(97), tcfg)
    with pytest.raises(Eagle3Error, match="different families"):
        draft_config_from_hf({**plain, "model_type": "gpt_oss", "target_model_type": "mixtral"})

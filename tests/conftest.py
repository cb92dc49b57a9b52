"""Shared fixtures: tiny randomly initialised transformers models for every family, built offline,
and the tiny llama with a random draft head (shared helpers: helpers.py)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiling is three quarters of the suite's time (the tiny models run in microseconds), and
# XLA:CPU spends most of a compilation making machine code: the tests compile at LLVM -O0 with
# XLA's older loop emitters for fused elementwise code (its MLIR fusion emitters, the default,
# cost more to compile at -O0), in half the time (test_speculative.py's first six tests: 8 s of
# compiling where the default takes 16). The programs are the same (XLA's passes, its fusion
# decisions and library calls do not change), though the code rounds a few operations
# differently (1e-6 relative on the tiny models): every assertion compares programs compiled
# alike, or within a tolerance, and holds either way.
# `make test-slow` and the tools run at XLA's default level; EAGLE3_JAX_TEST_XLA_OPT=default (or
# an XLA_FLAGS of your own) gives it here too.
_opt = os.environ.get("EAGLE3_JAX_TEST_XLA_OPT", "0")
os.environ.setdefault(
    "XLA_FLAGS",
    "--xla_force_host_platform_device_count=8"
    + (
        ""
        if _opt == "default"
        else f" --xla_backend_optimization_level={int(_opt)} --xla_cpu_use_fusion_emitters=false"
    ),
)
# the command-line tools keep compiled programs on disk (compile_cache) under the user's cache;
# the tests never read or write that one
os.environ.setdefault("EAGLE3_JAX_COMPILATION_CACHE", "0")
# One compilation cache per test session instead, empty at its start and removed at its end:
# tests that build the same program (a training step of the shared tiny config, a round of the
# same tree, the command-line tools run as subprocesses) compile it once, whichever pytest-xdist
# worker or subprocess gets there first. The controller makes it, before the workers start, and
# they and every subprocess inherit it. EAGLE3_JAX_TEST_COMPILE_CACHE=0 compiles everything anew.
if (
    "PYTEST_XDIST_WORKER" not in os.environ
    and "JAX_COMPILATION_CACHE_DIR" not in os.environ
    and os.environ.get("EAGLE3_JAX_TEST_COMPILE_CACHE", "1") != "0"
):
    _session_cache = tempfile.mkdtemp(prefix="eagle3_jax_test_xla_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _session_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
    atexit.register(shutil.rmtree, _session_cache, True)

import pytest  # noqa: E402

_maps = {"peak": 0, "cleared": 0}


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    """A test process runs hundreds of tests (all of them, or a worker's share under `make
    test`'s pytest-xdist), and XLA:CPU maps every compiled kernel into it separately: ~370
    tests' programs pass Linux's vm.max_map_count (65,530), and the next compilation then
    crashes the process (a segfault inside XLA's compiler, as CI saw). After each test the
    programs held in memory are dropped once the mappings pass half the limit
    (compile_cache.release_if_crowded, what the long-lived tools do), in each worker alike."""
    yield
    from eagle3_jax import compile_cache

    counts = compile_cache._map_counts()
    if counts:
        _maps["peak"] = max(_maps["peak"], counts[0])
        _maps["limit"] = counts[1]
    _maps["cleared"] += compile_cache.release_if_crowded(0.5)


ACCELERATORS = ("gpu", "tpu")  # the markers of tests that mean something on that backend only


def _has_backend(name: str) -> bool:
    import jax

    try:
        return bool(jax.devices(name))
    except RuntimeError:  # "Unknown backend": none of its devices, or JAX_PLATFORMS leaves it out
        return False


def pytest_collection_modifyitems(config, items):
    """A test marked gpu or tpu is skipped where jax has no such backend. The suite runs on the
    CPU unless JAX_PLATFORMS says otherwise (above): `JAX_PLATFORMS=cuda pytest -m gpu` runs the
    GPU's."""
    wanted = {m for item in items for m in ACCELERATORS if item.get_closest_marker(m)}
    missing = {m for m in wanted if not _has_backend(m)}
    for item in items:
        for m in missing:
            if item.get_closest_marker(m):
                item.add_marker(pytest.mark.skip(reason=f"needs a {m}: jax has no {m} backend"))


def pytest_addoption(parser):
    parser.addoption(
        "--compile-stats",
        action="store_true",
        help="print each test file's wall time beside its XLA compilations (tests/compile_stats.py)",
    )


def pytest_configure(config):
    if config.getoption("--compile-stats"):
        from compile_stats import CompileStats

        config.pluginmanager.register(CompileStats(), "eagle3_compile_stats")
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerMaps(), "eagle3_worker_maps")


class _WorkerMaps:
    """Under pytest-xdist (`make test` runs 2 workers) every worker is its own process with its own
    mappings and limit: each sends its counts back, and the summary gives the highest peak and
    the clearings of all of them."""

    def pytest_sessionfinish(self, session):
        out = getattr(session.config, "workeroutput", None)
        if out is not None:  # in a worker
            out["eagle3_maps"] = dict(_maps)

    def pytest_testnodedown(self, node, error):
        got = getattr(node, "workeroutput", {}).get("eagle3_maps")
        if got and got["peak"]:
            _maps["peak"] = max(_maps["peak"], got["peak"])
            _maps["limit"] = got["limit"]
            _maps["cleared"] += got["cleared"]


def pytest_terminal_summary(terminalreporter):
    if _maps["peak"]:
        terminalreporter.write_line(
            f"memory mappings: peak {_maps['peak']:,} of {_maps['limit']:,} allowed (per "
            f"process); compiled programs dropped {_maps['cleared']} times"
        )


FAMILY_CONFIGS = {
    "llama": dict(
        cls="LlamaConfig",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(cls="MistralConfig", sliding_window=12),
    "qwen2": dict(cls="Qwen2Config"),
    "qwen3": dict(cls="Qwen3Config", head_dim=16),
    "olmo2": dict(cls="Olmo2Config"),
}
FAMILIES = list(FAMILY_CONFIGS)


def tiny_hf_model(family: str, seed: int = 0, tie: bool = False, scale: float = 0.08):
    """A ~100k-parameter transformers model of `family` with random weights (fp32, eval mode)."""
    import transformers

    spec = dict(FAMILY_CONFIGS[family])
    cls = getattr(transformers, spec.pop("cls"))
    base = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen2":
        base["use_sliding_window"] = False
    base.update(spec)
    return random_hf_model(cls(**base), seed, scale)


def random_hf_model(config, seed: int = 0, scale: float = 0.08):
    """The transformers causal LM of `config` with random weights (fp32, eval mode): norms around
    1, biases around 0, the rest N(0, scale^2)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so their placement is really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> (transformers model, saved checkpoint directory)."""
    cache = {}

    def get(family: str, tie: bool = False):
        if (family, tie) not in cache:
            model = tiny_hf_model(family, tie=tie)
            d = tmp_path_factory.mktemp(f"{family}_{tie}")
            model.save_pretrained(d)
            cache[(family, tie)] = (model, d)
        return cache[(family, tie)]

    return get


def write_tiny_tokenizer(directory, vocab_size: int = 97) -> None:
    """A word-level tokenizer over "w3".."w{V-1}" with a chat template, saved beside a tiny model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    tok.chat_template = (
        "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}<s> {% endif %}"
    )
    tok.save_pretrained(directory)


@pytest.fixture(scope="session")
def tiny_target_dir(hf_checkpoint):
    """A tiny llama checkpoint directory with a tokenizer: a complete --target for the CLI."""
    _, path = hf_checkpoint("llama")
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def sharp_target_dir(tmp_path_factory):
    """A tiny llama with large weights: peaked next-token distributions a head can learn to match
    (the default tiny models are nearly uniform, so their argmax is noise)."""
    model = tiny_hf_model("llama", seed=1, scale=0.3)
    d = tmp_path_factory.mktemp("sharp_llama")
    model.save_pretrained(d)
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def spec_setup(hf_checkpoint):
    """The tiny llama and a random head over a 60-of-97 draft vocabulary (the top of random
    counts): (params, cfg, dparams, dcfg, vocab), for the speculative, verify and sharding tests."""
    import jax
    import numpy as np

    from eagle3_jax.checkpoints.hf import load_hf
    from eagle3_jax.models import draft as drf
    from eagle3_jax.vocab import build_from_counts

    _, path = hf_checkpoint("llama")
    params, cfg = load_hf(path)
    counts = np.random.default_rng(1).integers(0, 100, cfg.vocab_size)
    vocab = build_from_counts(counts, 60)
    dcfg = drf.DraftConfig.from_target(cfg, draft_vocab_size=60)
    dparams = drf.init_params(dcfg, jax.random.PRNGKey(0), scale=0.2)
    return params, cfg, dparams, dcfg, vocab

"""Shared factories: tiny random-weight models of the real architectures, saved as HF checkpoints."""

from __future__ import annotations

import json
import os

import pytest
import torch

# Triton kernels run in its interpreter on a CPU machine. It must be on before any kernel is defined,
# i.e. before the first pdserve import, so it is set here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 512
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention keeps the KV cache in fixed-size pages; prefix caching shares them.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 東京は日本の首都です。",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
] * 4


def make_tokenizer_files(path: str) -> None:
    """A small byte-level BPE tokenizer (vocab VOCAB) with <s>, </s> and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    tk.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({
            "bos_token": "<s>", "eos_token": "</s>",
            "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                             "{% if add_generation_prompt %}<s>assistant:{% endif %}",
        }, f)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


def hf_config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=10000.0)
    if family == "llama-plain":  # no rope scaling: what a GGUF file without rope metadata describes
        return tf.LlamaConfig(**common, rope_theta=10000.0)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=24)
    if family == "qwen2":
        return tf.Qwen2Config(**{**common, "tie_word_embeddings": True})
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    raise ValueError(family)


def build_hf_model(family: str, seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(family)
    cls = {"llama": tf.LlamaForCausalLM, "llama-plain": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
           "qwen3": tf.Qwen3ForCausalLM}[family]
    model = cls(cfg).float().eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0; random values exercise them too.
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0, 0.08)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """family -> (checkpoint dir, HF model) for each supported family."""
    out = {}
    for family in FAMILIES:
        path = str(tmp_path_factory.mktemp(f"tiny-{family}"))
        model = build_hf_model(family)
        model.save_pretrained(path)
        make_tokenizer_files(path)
        out[family] = (path, model)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(autouse=True, scope="session")
def _cache_dir(tmp_path_factory):
    # Converted GGUF files go to a per-run cache unless one is given (CI reuses the embedded model's).
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))


def assert_pool_clean(engine) -> None:
    """The invariant every test ends on: accounting holds and no request holds a page."""
    engine.check()
    assert not engine.has_work()
    s = engine.stats()
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.fixture
def played(tiny_llama):
    """Real workers on the tiny Llama, in this process, whose coordinator the test plays (tests/played.py)."""
    from played import PlayedCluster

    c = PlayedCluster(tiny_llama[0])
    yield c
    c.close()

"""GGUF checkpoints load into the same model as their dequantized reference, tokenizer included."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from conftest import assert_pool_clean, build_hf_model, make_tokenizer_files, rel_err
from engine import Engine, SamplingParams
from engine.gguf_file import permute_rope, unpermute_rope
from engine.loader import embedded_model_path
from test_models import record_logits

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# GGUF name and quantization for each HF tensor of layer i.
LAYER_TENSORS = {
    "self_attn.q_proj": ("attn_q", Q.Q8_0),
    "self_attn.k_proj": ("attn_k", Q.Q8_0),
    "self_attn.v_proj": ("attn_v", Q.Q4_1),
    "self_attn.o_proj": ("attn_output", Q.Q4_1),
    "mlp.gate_proj": ("ffn_gate", Q.Q4_1),
    "mlp.up_proj": ("ffn_up", Q.Q8_0),
    "mlp.down_proj": ("ffn_down", Q.Q4_1),
    "input_layernorm": ("attn_norm", Q.F32),
    "post_attention_layernorm": ("ffn_norm", Q.F32),
}


def llama_cpp_rope_freqs(cfg) -> np.ndarray:
    """What llama.cpp's converter writes for a Llama 3 rope scaling: one divisor per rotary frequency."""
    s = cfg.rope_parameters
    dim = cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(path: str, hf_model, tokenizer_dir: str, eot: int | None = None,
               add_bos: bool | None = None) -> dict[str, torch.Tensor]:
    """Write `hf_model` as a llama GGUF the way llama.cpp does (q/k rows permuted, weights quantized, a
    Llama 3 rope scaling as per-frequency factors); return the HF-named, dequantized tensors the file holds."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg))
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tk = json.load(f)
    vocab = sorted(tk["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in ("<pad>", "<s>", "</s>") else 1 for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if eot is not None:
        w.add_eot_token_id(eot)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")

    ref: dict[str, torch.Tensor] = {}

    def put(gguf_name: str, hf_name: str, qtype, heads: int | None = None):
        data = hf_model.state_dict()[hf_name].float().numpy()
        if heads is not None:
            data = permute_rope(data, heads)
        if qtype == Q.F32:
            stored, deq = data, data
        else:
            stored = gguf.quants.quantize(data, qtype)
            deq = gguf.quants.dequantize(stored, qtype).reshape(data.shape)
        w.add_tensor(gguf_name, stored, raw_dtype=qtype)
        ref[hf_name] = torch.from_numpy(unpermute_rope(deq, heads) if heads is not None else deq.copy())

    put("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    put("output_norm.weight", "model.norm.weight", Q.F32)
    put("output.weight", "lm_head.weight", Q.Q4_1)
    for i in range(cfg.num_hidden_layers):
        for hf_part, (g_part, qtype) in LAYER_TENSORS.items():
            heads = {"self_attn.q_proj": cfg.num_attention_heads,
                     "self_attn.k_proj": cfg.num_key_value_heads}.get(hf_part)
            put(f"blk.{i}.{g_part}.weight", f"model.layers.{i}.{hf_part}.weight", qtype, heads)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


@pytest.mark.parametrize("family", ["llama-plain", "llama"])
def test_quantized_gguf_loads_as_its_dequantized_reference(tmp_path, family):
    """"llama": Llama 3's rope scaling, which a GGUF file holds as one divisor per frequency (rope_freqs), and
    a BOS at the start of every prompt, as the file asks. Both files name an end-of-turn token, at which
    generation stops as at EOS."""
    hf = build_hf_model(family, seed=3)
    make_tokenizer_files(str(tmp_path))
    path = str(tmp_path / "tiny.gguf")
    ref = write_gguf(path, hf, str(tmp_path), eot=7, add_bos=family == "llama")
    assert any(t.tensor_type == Q.Q4_1 for t in gguf.GGUFReader(path).tensors)
    assert any(t.name == "rope_freqs.weight" for t in gguf.GGUFReader(path).tensors) == (family == "llama")

    engine = Engine(model_path=path, max_total_tokens=2048)
    ours = dict(engine.model.named_parameters())
    c = engine.config
    assert c.eos_token_ids == (2, 7)
    for i in range(c.num_hidden_layers):
        q, k, v = ours[f"layers.{i}.self_attn.qkv_proj.weight"].split([c.q_size, c.kv_size, c.kv_size])
        assert torch.equal(q, ref[f"model.layers.{i}.self_attn.q_proj.weight"])
        assert torch.equal(k, ref[f"model.layers.{i}.self_attn.k_proj.weight"])
        assert torch.equal(v, ref[f"model.layers.{i}.self_attn.v_proj.weight"])
        assert torch.equal(ours[f"layers.{i}.mlp.down_proj.weight"], ref[f"model.layers.{i}.mlp.down_proj.weight"])
    assert torch.equal(ours["embed_tokens.weight"], ref["model.embed_tokens.weight"])

    # The same model in transformers, given the dequantized tensors, predicts what ours predicts.
    hf_deq = build_hf_model(family, seed=3)
    hf_deq.load_state_dict({**hf_deq.state_dict(), **ref})
    seen = record_logits(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = [5, 9, 200, 13, 77, 31, 400] * 12
    req = engine.add_request(prompt, params)
    while engine.has_work():
        engine.step()
    with torch.no_grad():
        expect = hf_deq.generate(torch.tensor([req.prompt_ids]), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, req.prompt_len:].tolist()
        full = req.prompt_ids + req.output_ids
        ref_logits = hf_deq(torch.tensor([full])).logits[0, req.prompt_len - 1: len(full) - 1]
    assert req.output_ids == expect
    assert rel_err(torch.stack(seen[req.rid]), ref_logits) < 1e-4
    # The tokenizer came out of the GGUF metadata: it round-trips text like the original.
    text = "The quick brown fox"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text
    assert (engine.tokenizer.encode(text)[0] == 1) == (family == "llama")
    chat = engine.tokenizer.encode_chat([{"role": "user", "content": text}])
    assert chat[0] == 1 and chat[1] != 1  # the template's own BOS, not a second one
    assert_pool_clean(engine)


def test_gguf_tokenizer_matches_transformers_on_the_embedded_model():
    from transformers import AutoTokenizer

    path = embedded_model_path()
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    from engine.gguf_file import convert_gguf
    from engine.tokenizer import Tokenizer

    ours = Tokenizer(convert_gguf(path))
    texts = [
        "What is the capital of France?",
        "  leading spaces, numbers 1234567 and 3.14159",
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "Ünïcödé — 東京 🚀 tabs\tand\nnewlines\n\n",
        "def f(x):\n    return x**2  # comment",
    ]
    for t in texts:
        assert ours.encode(t) == ref.encode(t), t
        assert ours.decode(ours.encode(t), skip_special_tokens=False) == t


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((4 * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope(permute_rope(w, 4), 4), w)
    assert not np.array_equal(permute_rope(w, 4), w)


# Where each block keeps its float16 scales (d, and dmin where there is one), for the types gguf-py can
# dequantize but not quantize.
_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,),
                  Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def _random_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random but valid blocks: random bytes, with small finite scales where the block keeps them."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, block_bytes), dtype=np.uint8)
    scale = np.full((rows, cols // block), 0.002, dtype=np.float16).view(np.uint8).reshape(rows, cols // block, 2)
    for at in _SCALE_OFFSETS[qtype]:
        raw[..., at:at + 2] = scale
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1", "F16",
                                   "BF16", "Q4_0"])
def test_other_tensor_types_load_as_gguf_dequantizes_them(tmp_path, qtype):
    """Each supported type reaches the model exactly as gguf-py dequantizes it (256-wide rows for K-quants)."""
    import transformers as tf

    qt = getattr(Q, qtype)
    rng = np.random.default_rng(1)
    make_tokenizer_files(str(tmp_path))
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    path = str(tmp_path / f"{qtype}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for fn, v in ((w.add_block_count, 1), (w.add_context_length, 256), (w.add_embedding_length, 256),
                  (w.add_feed_forward_length, 512), (w.add_head_count, 4), (w.add_head_count_kv, 2)):
        fn(v)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    with open(tmp_path / "tokenizer.json") as f:
        tk = json.load(f)
    vocab = sorted(tk["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]])
    expect = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":  # tied: GGUF has no output tensor
            continue
        gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(name)
        if gname is None:
            part = name.split(".")
            gname = f"blk.{part[2]}.{LAYER_TENSORS['.'.join(part[3:-1])][0]}.weight"
        data = t.float().numpy()
        if data.ndim == 1:
            w.add_tensor(gname, data)
            expect[name] = data
            continue
        if qt in _SCALE_OFFSETS:
            stored = _random_blocks(data.shape[0], data.shape[1], qt, rng)
        else:
            stored = gguf.quants.quantize(data, qt)
        w.add_tensor(gname, stored, raw_dtype=qt)
        deq = gguf.quants.dequantize(stored, qt).reshape(data.shape).astype(np.float32)
        heads = {"self_attn.q_proj": 4, "self_attn.k_proj": 2}.get(".".join(name.split(".")[3:-1]))
        expect[name] = unpermute_rope(deq, heads) if heads else deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    engine = Engine(model_path=path, max_total_tokens=512)
    ours = dict(engine.model.named_parameters())
    q, k, _ = ours["layers.0.self_attn.qkv_proj.weight"].split([256, 128, 128])
    assert torch.equal(q, torch.from_numpy(expect["model.layers.0.self_attn.q_proj.weight"]))
    assert torch.equal(k, torch.from_numpy(expect["model.layers.0.self_attn.k_proj.weight"]))
    assert torch.equal(ours["layers.0.mlp.down_proj.weight"], torch.from_numpy(expect["model.layers.0.mlp.down_proj.weight"]))
    assert torch.equal(ours["embed_tokens.weight"], torch.from_numpy(expect["model.embed_tokens.weight"]))
    assert engine.config.tie_word_embeddings


def _write_sentencepiece_gguf(path: str) -> None:
    """A SentencePiece BPE vocabulary as llama.cpp stores one (Llama 2, Mistral 7B): <unk>, control tokens,
    the 256 byte tokens, then pieces with scores that fall with their rank; no merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from conftest import CORPUS

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"], show_progress=False))
    pieces = [t for t, _ in sorted(tk.get_vocab().items(), key=lambda kv: kv[1]) if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (5 + 256) + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_vocabulary_tokenizes_as_transformers_reads_the_file(tmp_path):
    """A SentencePiece GGUF (no merges, scores instead) gives the tokenizer transformers builds from the same
    file: the same ids for plain text, spaces, text outside the vocabulary (as byte tokens) and control
    tokens; BOS first, since the file does not say otherwise; and text back from ids."""
    from transformers import AutoTokenizer

    from engine.gguf_file import GGUFModel
    from engine.tokenizer import Tokenizer

    _write_sentencepiece_gguf(str(tmp_path / "spm.gguf"))
    tk_json, tk_config = GGUFModel(str(tmp_path / "spm.gguf")).tokenizer_files()
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    (ours_dir / "tokenizer.json").write_text(json.dumps(tk_json))
    (ours_dir / "tokenizer_config.json").write_text(json.dumps(tk_config))
    ours = Tokenizer(str(ours_dir))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Paged attention keeps the KV cache in fixed-size pages",
        "  two leading spaces,   three inside, and a trailing one ",
        "def add(a, b):\n    return a + b\n",
        "Zwölf Boxkämpfer 東京 🚀 — outside the vocabulary",
        "[INST] what is paged attention? [/INST]",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 1 and ids.count(1) == 1
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert ours.decode(ours.encode(texts[4])) == texts[4]  # byte tokens fuse back into the characters
    assert 3 in ours.encode(texts[5]) and 4 in ours.encode(texts[5])  # control tokens match whole


def test_conversion_writes_shards_of_bounded_size_that_hold_every_tensor(tmp_path, monkeypatch):
    """A large file converts a shard at a time: each shard within the bound (or one tensor), the index
    naming each tensor's shard, every tensor as the file dequantizes it, and the engine loading the shards."""
    from engine.gguf_file import GGUFModel, convert_gguf
    from engine.weights import iter_safetensors

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    make_tokenizer_files(str(tmp_path))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, build_hf_model("llama", seed=4), str(tmp_path))
    bound = 64 << 10
    out = convert_gguf(path, shard_bytes=bound)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(shards) > 3
    assert sorted(n for n in os.listdir(out) if n.endswith(".safetensors")) == shards
    converted = dict(iter_safetensors(out))
    for shard in shards:
        held = [converted[n] for n, s in weight_map.items() if s == shard]
        assert len(held) == 1 or sum(t.nbytes for t in held) <= bound
    expect = dict(GGUFModel(path).tensors())
    assert converted.keys() == expect.keys() == weight_map.keys()
    assert all(torch.equal(converted[n], expect[n]) for n in expect)
    assert convert_gguf(path) == out  # converted once
    assert not [n for n in os.listdir(os.path.dirname(out)) if n != os.path.basename(out)]  # nothing left over
    engine = Engine(model_path=path, max_total_tokens=512)
    assert torch.equal(engine.model.embed_tokens.weight, expect["model.embed_tokens.weight"])


@pytest.mark.parametrize("keep", [100, 5_000, 1_000_000, 98_000_000])
def test_a_gguf_file_cut_short_is_refused_by_name(tmp_path, keep, monkeypatch):
    """A download that stopped part way (in the header, the metadata or the tensor data) is refused with the
    file's name and size, not numpy's complaint about a reshape, and leaves nothing in the conversion cache."""
    from engine.gguf_file import convert_gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cut = tmp_path / "cut.gguf"
    with open(embedded_model_path(), "rb") as f:
        cut.write_bytes(f.read(keep))
    with pytest.raises(ValueError, match=rf"cut\.gguf: not a readable GGUF file \({keep:,} bytes"):
        convert_gguf(str(cut))
    assert not any(files for _, _, files in os.walk(tmp_path / "cache"))

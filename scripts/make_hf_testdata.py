#!/usr/bin/env python3
"""Builds test/data/hf/: tiny Hugging Face models and tokenizers, and transformers' own outputs on
them, the fixed side of test/test_python.sh's checks of scripts/import_hf.py, export_hf.py and
dev/data/prepare_text.py --tokenizer HF_DIR. Run once, by hand; CI never runs it:

    /work/venv-hf/bin/python scripts/make_hf_testdata.py [test/data/hf]

NEEDS torch and transformers (written with torch 2.15, transformers 5.25), and tokenizers; offline,
fixed seeds. It writes:

  llama/        LlamaForCausalLM, fp32 model.safetensors + config.json (as save_pretrained writes
                them): 2 layers, hidden 64, 4 heads of 16, 2 kv heads, intermediate 128, vocab 1000,
                max_position_embeddings 256, rms_norm_eps 1e-5, rope_theta 5e5 with llama3 scaling
                (factor 8, low 1, high 4, original_max_position_embeddings 64: at head_dim 16 the
                first frequency is kept, the second interpolated, the other six divided by 8), an
                untied lm head. Beside it a byte-level BPE tokenizer.json (<= 1000 tokens,
                <|begin_of_text|> / <|end_of_text|>, a post-processor that adds the BOS as Llama 3's
                does) and tokenizer_config.json (bos_token <|begin_of_text|>).
  qwen2/        Qwen2ForCausalLM, fp32: the same sizes, q/k/v biases, the head tied to the embedding,
                rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 256; a byte-level BPE with
                <|endoftext|>, <|im_start|>, <|im_end|> and tokenizer_config.json (no bos_token,
                eos_token <|im_end|> as Qwen2's instruct models have).
  qwen2_bf16/   the qwen2 model cast to bfloat16 by torch, saved in 2 shards
                (model.safetensors.index.json + model-0000N-of-00002.safetensors).
  sp_tokenizer/ a SentencePiece-style tokenizer.json (Llama 2's pipeline: "▁" for spaces, a
                byte fallback to <0x00>..<0xFF>, <unk> <s> </s>) + tokenizer_config.json (bos <s>).
  ref_llama.npz, ref_qwen2.npz  (numpy .npz, uncompressed; np.load reads them):
                doc0, doc1, doc2   int32 token ids of 3 documents of 5, 17 and 40 tokens (the
                                   first is the model's document token: Llama's BOS, Qwen2's
                                   <|endoftext|>; the rest random over the whole vocab of 1000)
                logits0..logits2   float32 [len, 1000]: transformers' logits for each document run
                                   as its own row (positions 0..len-1), fp32 on the CPU
                prompt             int32: a short text's tokens (with the document token first)
                greedy             int32 [64]: the 64 tokens transformers decodes greedily after it
                                   (generate(do_sample=False), checked equal to argmax of full
                                   forwards)
                greedy_min_gap     float32: the smallest gap between the best and the second best
                                   logit along the greedy path (how far a tie is)

The weights are random but scaled so the logits are O(1) and far from uniform: embeddings and
the lm head std 2/sqrt(hidden), projections std 1/sqrt(fan_in), norm weights in [0.5, 1.5], biases
std 0.3 (init std 0.02 would give near-uniform logits that any wrong op would still match).
"""
import json
import os
import random
import sys

import numpy as np
import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, INTER, LAYERS, MAX_POS = 1000, 64, 4, 2, 128, 2, 256
DOC_LENS = (5, 17, 40)
PROMPT_TEXT = "the quick brown fox"
N_GREEDY = 64

WORDS = ("the quick brown fox jumps over lazy dog a model of words and numbers trains on text to predict the next "
         "token from every one before it in a document river mountain city light night day green small large "
         "আমি বাংলায় গান গাই আমার সোনার বাংলা কলকাতা ঢাকা নদী").split()


def corpus(n_docs, seed):
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(5, 40))) + r.choice([".", "!", "?", ", 42."])
            for _ in range(n_docs)]


def byte_level_bpe(vocab_size, specials, bos=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(400, 1), trainer=trainer)
    tok.add_special_tokens(specials)  # after the BPE's tokens, as Llama 3's and Qwen2's are
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


def sentencepiece_style():
    """Llama 2's tokenizer pipeline, made with `tokenizers`: a BPE over "▁"-spelled text with byte
    fallback (<0xXX>), <unk> <s> </s> first."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    sp = Tokenizer(models.BPE())  # trained on words ("▁the"), as sentencepiece's merges are
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    sp.train_from_iterator(corpus(200, 2), trainer=trainer)
    learned = json.loads(sp.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if piece not in vocab:
            vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    text = "the quick fox, আমার 42"
    assert tok.decode(tok.encode(text).ids) == text, tok.decode(tok.encode(text).ids)
    return tok


def scale_weights(model, g):
    """Random weights for which the logits are O(1) and depend on every op."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:  # (the tied head's too: logits std ~2)
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name == "lm_head.weight":
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def reference(model, doc_token, prompt_ids, seed):
    g = np.random.default_rng(seed)
    out = {}
    with torch.no_grad():
        for k, n in enumerate(DOC_LENS):
            doc = np.concatenate([[doc_token], g.integers(0, VOCAB, n - 1)]).astype(np.int32)
            logits = model(torch.tensor(doc[None].astype(np.int64))).logits[0].float().numpy()
            out[f"doc{k}"], out[f"logits{k}"] = doc, logits.astype(np.float32)
        prompt = np.array(prompt_ids, dtype=np.int32)
        gen = model.generate(torch.tensor(prompt[None].astype(np.int64)), max_new_tokens=N_GREEDY,
                             min_new_tokens=N_GREEDY, do_sample=False, num_beams=1, pad_token_id=0)
        greedy = gen[0, len(prompt):].numpy().astype(np.int32)
        # the same by argmax of full forwards (no cache), and the margin to a tie along the path
        row, gaps = list(prompt), []
        for _ in range(N_GREEDY):
            last = model(torch.tensor([row])).logits[0, -1].double().numpy()
            top2 = np.sort(last)[-2:]
            gaps.append(top2[1] - top2[0])
            row.append(int(last.argmax()))
        assert row[len(prompt):] == greedy.tolist(), "generate() and full forwards disagree"
    out["prompt"], out["greedy"], out["greedy_min_gap"] = prompt, greedy, np.float32(min(gaps))
    print(f"  logits std {np.std(out['logits2']):.2f}, max |logit| {np.abs(out['logits2']).max():.2f}, "
          f"greedy {greedy[:12].tolist()}..., smallest top-2 gap {min(gaps):.4f}")
    return out


def main():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "test", "data", "hf")
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)

    # ---- Llama: llama3 rope scaling, untied head
    tok = byte_level_bpe(VOCAB, ["<|begin_of_text|>", "<|end_of_text|>"], bos="<|begin_of_text|>")
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|end_of_text|>")
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    model = LlamaForCausalLM(cfg).float().eval()
    scale_weights(model, torch.Generator().manual_seed(1))
    d = os.path.join(root, "llama")
    model.save_pretrained(d)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": MAX_POS,
                   "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True}, f, indent=2)
    print("llama:")
    np.savez(os.path.join(root, "ref_llama.npz"),
             **reference(model, bos, tok.encode(PROMPT_TEXT).ids, seed=2))  # the post-processor adds the BOS

    # ---- Qwen2: q/k/v biases, tied head
    tok = byte_level_bpe(VOCAB, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=MAX_POS,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eot, eos_token_id=im_end,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False,
                      max_window_layers=LAYERS)
    model = Qwen2ForCausalLM(cfg).float().eval()
    scale_weights(model, torch.Generator().manual_seed(3))
    d = os.path.join(root, "qwen2")
    model.save_pretrained(d)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "model_max_length": MAX_POS, "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    print("qwen2:")
    np.savez(os.path.join(root, "ref_qwen2.npz"), **reference(model, eot, [eot] + tok.encode(PROMPT_TEXT).ids, seed=4))
    # the same model in bf16, two shards
    d16 = os.path.join(root, "qwen2_bf16")
    model.to(torch.bfloat16).save_pretrained(d16, max_shard_size="150KB")
    index = json.load(open(os.path.join(d16, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) == 2, index

    # ---- a SentencePiece-style tokenizer
    d = os.path.join(root, "sp_tokenizer")
    os.makedirs(d, exist_ok=True)
    sentencepiece_style().save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)

    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(root) for f in fs)
    print(f"wrote {root}: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

// Our engine's logits for one row of tokens, from a checkpoint: the other side of the exported
// models' checks (test/test_python.sh compares them with a numpy GPT-2 on the Hugging Face
// tensors; scripts/compare_hf.py with transformers' GPT2LMHeadModel).
//
//   forward_logits CHECKPOINT TOKENS OUT
//     TOKENS  int32 token ids (one row of T <= max_seq_len tokens, little-endian)
//     OUT     float32 logits [T, vocab_size] (the padding columns dropped)
// The row is one document (doc_start = 0 everywhere, whatever its tokens are): plain causal
// attention and positions 0..T-1, as in GPT-2 and llm.c. CPU build, fp32.
#define LLMC_CPU
#define LLMC_NO_MAIN
#include "../train_gpt.cu"

int main(int argc, char** argv) {
    try {
        LLMC_CHECK(argc == 4, "usage: forward_logits CHECKPOINT TOKENS OUT");
        const Checkpoint ck = verify_checkpoint(CommGroup{}, argv[1]);
        const GPTConfig c = config_from_checkpoint(ck, argv[1]);
        const long long bytes = file_size_bytes(argv[2]);
        LLMC_CHECK(bytes > 0 && bytes % 4 == 0, "%s: expected int32 token ids, the file has %lld bytes", argv[2], bytes);
        std::vector<int> tokens(bytes / 4);
        FILE* f = fopen_or_fail(argv[2], "rb");
        fread_or_fail(tokens.data(), bytes, f, argv[2], "tokens");
        fclose(f);
        const int T = (int)tokens.size();
        for (int t : tokens) LLMC_CHECK(t >= 0 && t < c.vocab_size, "%s: token %d is outside [0, %d)", argv[2], t, c.vocab_size);
        GPT m;
        gpt_allocate(m, c, 1, T);
        LLMC_CHECK(ck.n_params == m.n_params, "%s: %llu parameters, the config needs %zu", argv[1],
                   (unsigned long long)ck.n_params, m.n_params);
        const CheckpointFile file(argv[1], ck);  // streamed: the parameters the model holds
        gpt_set_state(m, [&](size_t begin, size_t n, float* p, float*, float*) { file.read(0, begin, n, p); });
        std::vector<int> doc_start(T, 0);
        const std::vector<float> logits = gpt_logits(m, tokens.data(), doc_start.data(), 1, T);
        std::vector<float> out;
        for (int t = 0; t < T; t++)
            out.insert(out.end(), logits.begin() + (size_t)t * c.padded_vocab_size,
                       logits.begin() + (size_t)t * c.padded_vocab_size + c.vocab_size);
        AtomicFile o(argv[3]);
        o.write(out.data(), out.size() * sizeof(float));
        o.commit();
        gpt_free(m);
        return 0;
    } catch (const LlmcError& e) {
        fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
}

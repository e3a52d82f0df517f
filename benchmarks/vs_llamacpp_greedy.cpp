// Greedy decoding through llama.cpp's C API, for benchmarks/vs_llamacpp.py's agreement check:
//
//   vs_llamacpp_greedy MODEL.gguf THREADS N TOKEN...
//
// decodes the prompt TOKEN... in one batch, then N greedy tokens one decode call each (the path a
// server's generation takes), KV cache in fp32, flash attention off. Prints one line per token:
// "<id> <logprob>", the logprob from a log-softmax over the raw logits in double (llama-server merges
// a token that ends inside a UTF-8 character into the next one in its probabilities, so it cannot
// report every token's).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS N TOKEN...\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]);
    const int n = atoi(argv[3]);
    std::vector<llama_token> prompt;
    for (int i = 4; i < argc; i++) prompt.push_back((llama_token) atoi(argv[i]));

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (prompt.size() + n + 16);
    cp.n_batch = cp.n_ctx;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
    llama_token next = 0;
    for (int step = 0; step < n; step++) {
        if (llama_decode(ctx, batch) != 0) {
            fprintf(stderr, "llama_decode failed at step %d\n", step);
            return 1;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        double top = logits[0];
        for (int v = 1; v < vocab; v++) {
            if (logits[v] > top) {
                top = logits[v];
                best = v;
            }
        }
        double sum = 0.0;
        for (int v = 0; v < vocab; v++) sum += std::exp((double) logits[v] - top);
        printf("%d %.9g\n", best, -std::log(sum));  // logprob of the argmax: logit - top - log(sum) = -log(sum)
        next = (llama_token) best;
        batch = llama_batch_get_one(&next, 1);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}

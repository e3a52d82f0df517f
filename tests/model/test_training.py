"""Training a checkpoint on the corpus: the corpus is clean prose, the training network is the published
format (transformers and the engine compute the same logits and greedy tokens from what it writes, the
engine's MTP layer the same next-next-token logits), and a short run lowers both losses,
deterministically."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from epserve import LLM, SamplingParams
from epserve.engine.request import Request, ScheduledChunk
from epserve.engine.runner import BatchPlan
from epserve.training import TRAIN_PRESETS, train_checkpoint
from epserve.training.corpus import clean_topic, load_corpus
from epserve.training.distill import distill_loss, distill_mtp
from epserve.training.train import (
    build_model,
    corpus_tokens,
    distill_checkpoint,
    evaluate,
    model_config,
    train_model,
    write_trained,
)

SETUP = TRAIN_PRESETS["test"]
SEQS = [[0, 5, 17, 99, 3, 250, 42], [0] + list(range(10, 60)), [0, 7], [0] + [(i * 37) % 500 + 4 for i in range(30)]]


def test_corpus_is_english_prose_and_deterministic():
    corpus = load_corpus()
    assert len(corpus.text) > 200_000
    assert corpus.heldout and 0.01 < len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout)) < 0.05
    assert not set(corpus.train) & set(corpus.heldout)
    lines = corpus.text.splitlines()
    assert not any(s.lstrip().startswith((">>>", "...")) or "::=" in s for s in lines)
    assert all(s == s.strip() and "  " not in s for s in lines)
    words = re.findall(r"[a-z]+", corpus.text.lower())
    assert words.count("the") / len(words) > 0.04  # English: "the" is ~5% of words
    assert load_corpus.__wrapped__() == corpus  # recomputed from scratch: the same paragraphs


def test_clean_topic_drops_code_blocks_and_keeps_prose():
    topic = (
        "The \"for\" statement\n*******************\n\nIt loops over an iterable, as in this\nexample:\n\n"
        "   for i in range(3):\n       print(i)\n\n>>> print(1)\n1\n\n   for_stmt ::= \"for\" target_list\n\n"
        "Note:\n\n   Changing the sequence while looping is\n   not a good idea.\n"
    )
    assert clean_topic(topic) == [
        'The "for" statement',
        "It loops over an iterable, as in this example:",
        "Changing the sequence while looping is not a good idea.",
    ]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A randomly initialised ``test``-shape training model (non-zero routing biases) and the fp32
    checkpoint written from it."""
    tok, _, _ = corpus_tokens(SETUP.vocab_size)
    config = model_config(SETUP, tok.get_vocab_size(), "float32")
    model = build_model(config, seed=3)
    model.init_weights(torch.Generator().manual_seed(3), std=0.1)  # larger weights: sharper logits
    gen = torch.Generator().manual_seed(4)
    for moe in model.moe_layers():
        moe.e_score_correction_bias.normal_(0.0, 0.05, generator=gen)
    path = write_trained(tmp_path_factory.mktemp("trained"), model, config, load_corpus().text, SETUP.vocab_size,
                         "float32")
    return model.eval(), path


def test_transformers_reads_the_same_main_model(written):
    transformers = pytest.importorskip("transformers")
    model, path = written
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for seq in SEQS:
        ids = torch.tensor([seq])
        with torch.no_grad():
            ref = hf(ids).logits[0]
            ours = model(ids)[0][0]
        assert ref.std() > 0.3
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_checkpoint_layout(written):
    model, path = written
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["vocab_size"] == json.loads((path / "tokenizer.json").read_text())["model"]["vocab"].__len__()
    mtp = f"model.layers.{config['num_hidden_layers']}"
    tensors = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            tensors |= {k: st.get_tensor(k) for k in st.keys()}
    assert torch.equal(tensors[f"{mtp}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(tensors[f"{mtp}.shared_head.head.weight"], tensors["lm_head.weight"])
    assert not torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])
    assert torch.equal(tensors[f"{mtp}.eh_proj.weight"], model.mtp.eh_proj.weight)
    assert tensors[f"{mtp}.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    gate_up = model.mtp.layer.mlp.w_gate_up[5]
    assert torch.equal(torch.cat([tensors[f"{mtp}.mlp.experts.5.gate_proj.weight"],
                                  tensors[f"{mtp}.mlp.experts.5.up_proj.weight"]]), gate_up)


def test_engine_greedy_matches_training_model(written):
    model, path = written
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=64)
    prompts = [seq[1:] for seq in SEQS[1:]]  # the engine's tokenizer adds bos; token-id prompts do not
    outs = llm.generate([[0, *p] for p in prompts], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = [0, *prompt]
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
        assert out.token_ids == ids[len(prompt) + 1 :]


def _short_run(steps: int = 25) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    tok, train_ids, _ = corpus_tokens(SETUP.vocab_size)
    model = build_model(model_config(SETUP, tok.get_vocab_size(), "float32"), seed=0)
    result = train_model(model, train_ids, SETUP, steps=steps, max_seconds=1e9, seed=0, progress=False)
    return result.losses, result.mtp_losses, model.state_dict()


def test_short_training_lowers_both_losses_deterministically():
    losses, mtp_losses, weights = _short_run()
    assert sum(losses[-5:]) / 5 < losses[0] - 0.7
    assert sum(mtp_losses[-5:]) / 5 < mtp_losses[0] - 0.7
    losses2, mtp_losses2, weights2 = _short_run()
    assert losses2 == losses and mtp_losses2 == mtp_losses
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    biases = [v for k, v in weights.items() if k.endswith("e_score_correction_bias")]
    assert biases and all(b.abs().sum() > 0 for b in biases)  # the aux-loss-free balancing moved them


def test_self_distillation_trains_the_mtp_alone_towards_the_main_models_predictions():
    """The second phase moves the MTP module only (the main model, so its greedy output, is untouched; the
    shared embedding and head too), lowers its cross-entropy against the main model's next-position
    distribution, and raises how often its top-1 is the main model's (the acceptance of a greedy draft)."""
    tok, train_ids, heldout_ids = corpus_tokens(SETUP.vocab_size)
    model = build_model(model_config(SETUP, tok.get_vocab_size(), "float32"), seed=5)
    model.init_weights(torch.Generator().manual_seed(5), std=0.1)  # sharp main predictions to learn
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seqs = torch.stack([heldout_ids[i * 65 : i * 65 + 65] for i in range(8)])
    with torch.no_grad():
        loss0 = float(distill_loss(model, seqs))
    agreement0 = evaluate(model, heldout_ids, SETUP.seq_len, 2048)["mtp_agreement"]
    result = distill_mtp(model, train_ids, seq_len=32, batch_size=4, lr=3e-2, steps=6, max_seconds=1e9, seed=0,
                         progress=False)
    assert result.steps == 6 and len(result.losses) == 6
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    assert any(k.startswith("mtp.layer.") for k in changed) and "mtp.eh_proj.weight" in changed
    assert all(p.requires_grad for p in model.parameters())  # the frozen ones are trainable again
    with torch.no_grad():
        assert float(distill_loss(model, seqs)) < loss0 - 0.15  # (6.57 -> 6.33)
    assert evaluate(model, heldout_ids, SETUP.seq_len, 2048)["mtp_agreement"] > agreement0 + 0.015  # (0.002 -> 0.025)


@pytest.mark.slow
def test_train_checkpoint_writes_a_loadable_checkpoint(tmp_path):
    path = train_checkpoint(tmp_path / "ckpt", "test", steps=3, progress=False, dtype="bfloat16")
    summary = json.loads((path / "training.json").read_text())
    assert summary["steps"] == 3 and len(summary["loss_curve"]) == 3
    assert summary["distill_steps"] == 1 and len(summary["distill_loss_curve"]) == 1  # ceil(3 x 0.3)
    assert {"loss", "mtp_agreement"} <= set(summary["main_phase_heldout"])
    assert {"loss", "mtp_loss", "mtp_accuracy", "mtp_agreement"} <= set(summary["final_heldout"])
    assert "PSF" in summary["corpus_license"]
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 2048
    out = LLM(str(path), dtype="bfloat16", device="cpu", num_blocks=32).generate(
        "The for statement", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(ValueError, match="unknown training preset"):
        train_checkpoint(tmp_path / "x", "nope")
    # the distillation phase alone on the written checkpoint: the main model's tensors bit for bit
    distilled = distill_checkpoint(path, tmp_path / "distilled", steps=2, progress=False)
    a, b = (_tensors(p) for p in (path, distilled))
    mtp = f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}."
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if not k.startswith(mtp))
    assert not torch.equal(a[f"{mtp}eh_proj.weight"], b[f"{mtp}eh_proj.weight"])
    assert json.loads((distilled / "training.json").read_text())["distill_steps"] == 2


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            out |= {k: st.get_tensor(k) for k in st.keys()}
    return out


def test_engine_mtp_layer_matches_training_model(written):
    """The engine's MTP pass (``forward_mtp`` + ``compute_mtp_logits``, the MTP layer on its own cache
    layer) gives the training model's next-next-token logits at every position of a prefill."""
    model, path = written
    llm = LLM(str(path), dtype="float32", device="cpu", num_blocks=64, speculative="mtp")
    runner = llm.engine.runner
    for seq in SEQS:
        n = len(seq)
        with torch.no_grad():
            _, ref = model(torch.tensor([seq]))
        blocks = list(range(-(-n // runner.block_size)))

        def batch(tokens: list[int], blocks: list[int] = blocks):
            request = Request("probe", tokens, SamplingParams(max_tokens=1))
            request.block_ids = list(blocks)
            chunk = ScheduledChunk(request=request, start=0, num_tokens=len(tokens))
            return BatchPlan.from_chunks([chunk], runner.block_size).to_batch(runner.device, runner.block_size)

        with torch.inference_mode():
            hidden = runner.model(batch(seq), runner.kv_caches)  # writes the main layers' cache
            out = runner.model.forward_mtp(batch(seq[1:]), runner.kv_caches, hidden[: n - 1])
            ours = runner.model.compute_mtp_logits(out)
        assert ref is not None and ref.std() > 0.3
        torch.testing.assert_close(ours, ref[0], atol=1e-4, rtol=1e-4)

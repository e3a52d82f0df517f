"""``epserve make-checkpoint`` with shape flags (``--vocab-size`` and the others ``make_checkpoint``'s
``overrides`` take, ``--override KEY=VALUE`` for any config.json field): the checkpoint the Python API
writes for the same overrides, and a one-line error for a value or a shape the model refuses."""

from __future__ import annotations

import json

from epserve.checkpoint.reader import CheckpointReader
from epserve.cli import main
from epserve.presets import make_checkpoint


def test_shape_flags_write_the_python_apis_checkpoint(tmp_path, capsys):
    argv = ["make-checkpoint", str(tmp_path / "cli"), "--vocab-size", "1000", "--hidden-size", "48",
            "--num-hidden-layers", "2", "--num-attention-heads", "2", "--n-routed-experts", "8",
            "--num-experts-per-tok", "2", "--override", "n_group=2", "--override", "topk_group=1",
            "--override", "rope_theta=5000.0", "--dtype", "float32"]
    assert main(argv) == 0
    assert "vocab_size=1000 hidden_size=48" in capsys.readouterr().out
    overrides = {"vocab_size": 1000, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
                 "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
                 "topk_group": 1, "rope_theta": 5000.0}
    api = make_checkpoint(tmp_path / "api", overrides=overrides, dtype="float32")
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config == json.loads((api / "config.json").read_text())
    assert {k: config[k] for k in overrides} == overrides
    with CheckpointReader(tmp_path / "cli") as cli_reader, CheckpointReader(api) as api_reader:
        assert cli_reader.get("model.embed_tokens.weight").shape == (1000, 48)
        for name in api_reader.keys():
            assert cli_reader.get(name).equal(api_reader.get(name)), name


def test_bad_shapes_are_one_line_errors(tmp_path, capsys):
    cases = [
        (["--vocab-size", "1"], "--vocab-size must be an integer >= 2, got 1"),
        (["--hidden-size", "0"], "--hidden-size must be an integer >= 1, got 0"),
        (["--n-routed-experts", "6"], "the shape flags make a config the model refuses: n_routed_experts=6 is not "
                                      "divisible by n_group"),
        (["--override", "vocab_size"], "--override vocab_size: write KEY=VALUE"),
        (["--train", "--vocab-size", "300"], "--train trains its preset's shape"),
        (["--max-shard-bytes", "0"], "--max-shard-bytes must be >= 1"),
    ]
    for extra, message in cases:
        assert main(["make-checkpoint", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, (extra, err)
        assert not (tmp_path / "out").exists()

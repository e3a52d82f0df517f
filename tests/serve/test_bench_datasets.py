"""Tests of ``epserve bench serve``'s workload: the random and shared-prefix datasets, and Poisson arrivals."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from epserve.bench.datasets import arrival_offsets, make_dataset, poisson_delays


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------- datasets


def test_random_dataset_lengths_and_determinism() -> None:
    reqs = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=3,
                        random_input_len=40, random_output_len=7)
    assert len(reqs) == 50
    assert all(len(r.prompt_token_ids) == 40 and r.output_len == 7 and r.group is None for r in reqs)
    assert all(0 <= t < 100 for r in reqs for t in r.prompt_token_ids)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 50  # independent prompts
    assert max(common_prefix(reqs[0].prompt_token_ids, r.prompt_token_ids) for r in reqs[1:]) < 5
    same = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=3,
                        random_input_len=40, random_output_len=7)
    other = make_dataset("random", vocab_size=100, max_model_len=4096, num_prompts=50, seed=4,
                         random_input_len=40, random_output_len=7)
    assert [r.prompt_token_ids for r in same] == [r.prompt_token_ids for r in reqs]
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in reqs]


def test_random_range_ratio_bounds() -> None:
    reqs = make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=400, seed=0,
                        random_input_len=100, random_output_len=20, random_range_ratio=0.5)
    ins = [len(r.prompt_token_ids) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 50 <= min(ins) < 60 and 140 < max(ins) <= 150
    assert 10 <= min(outs) and max(outs) <= 30 and len(set(outs)) > 10
    assert make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=10,
                        random_input_len=3, random_range_ratio=1.0)  # lower bound kept >= 1


def test_default_num_prompts() -> None:
    assert len(make_dataset("random", vocab_size=10, max_model_len=4096, random_input_len=4)) == 128
    assert len(make_dataset("shared-prefix", vocab_size=10, max_model_len=4096, system_prompt_len=4,
                            question_len=2)) == 16 * 8


def test_shared_prefix_groups_share_exactly_system_prompt() -> None:
    reqs = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=1, num_groups=5,
                        prompts_per_group=6, system_prompt_len=33, question_len=9, output_len=4)
    assert len(reqs) == 30
    assert all(len(r.prompt_token_ids) == 42 and r.output_len == 4 for r in reqs)
    by_group: dict[int, list[list[int]]] = {}
    for r in reqs:
        assert r.group is not None
        by_group.setdefault(r.group, []).append(r.prompt_token_ids)
    assert sorted(by_group) == list(range(5)) and all(len(v) == 6 for v in by_group.values())
    for g, prompts in by_group.items():
        for i in range(len(prompts)):
            for j in range(i + 1, len(prompts)):
                assert common_prefix(prompts[i], prompts[j]) == 33  # the system prompt, not one token more
        for h, others in by_group.items():
            if h != g:
                assert common_prefix(prompts[0], others[0]) == 0
    again = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=1, num_groups=5,
                         prompts_per_group=6, system_prompt_len=33, question_len=9, output_len=4)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]


def test_shared_prefix_shuffled_interleaves_groups() -> None:
    reqs = make_dataset("shared-prefix", vocab_size=512, max_model_len=4096, seed=0, num_groups=8,
                        prompts_per_group=8, system_prompt_len=4, question_len=2)
    groups = [r.group for r in reqs]
    assert groups != sorted(groups)  # type: ignore[type-var]
    changes = sum(a != b for a, b in zip(groups, groups[1:]))
    assert changes > 40  # grouped order would change only 7 times
    assert len(set(groups[:16])) >= 5


def test_shared_prefix_num_prompts_truncates_and_cycles() -> None:
    kw: dict[str, Any] = dict(vocab_size=512, max_model_len=4096, seed=2, num_groups=3, prompts_per_group=2,
                              system_prompt_len=5, question_len=3)
    full = make_dataset("shared-prefix", **kw)
    assert [r.prompt_token_ids for r in make_dataset("shared-prefix", num_prompts=4, **kw)] == \
        [r.prompt_token_ids for r in full[:4]]
    cycled = make_dataset("shared-prefix", num_prompts=14, **kw)
    assert [r.prompt_token_ids for r in cycled] == [full[i % 6].prompt_token_ids for i in range(14)]


def test_clamping_to_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        reqs = make_dataset("random", vocab_size=50, max_model_len=64, num_prompts=20,
                            random_input_len=60, random_output_len=10, random_range_ratio=0.2)
    assert all(len(r.prompt_token_ids) + r.output_len <= 64 for r in reqs)
    assert len([rec for rec in caplog.records if "clamped" in rec.message]) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        reqs = make_dataset("shared-prefix", vocab_size=50, max_model_len=64, num_groups=2,
                            prompts_per_group=3, system_prompt_len=50, question_len=20, output_len=8)
    assert all(len(r.prompt_token_ids) == 56 and r.output_len == 8 for r in reqs)  # question shrinks first
    a, b = [r.prompt_token_ids for r in reqs if r.group == 0][:2]
    assert common_prefix(a, b) == 50
    assert len([rec for rec in caplog.records if "clamped" in rec.message]) == 1
    tiny = make_dataset("shared-prefix", vocab_size=50, max_model_len=10, num_groups=1, prompts_per_group=2,
                        system_prompt_len=50, question_len=20, output_len=50)
    assert all(len(r.prompt_token_ids) + r.output_len <= 10 and r.output_len >= 1 for r in tiny)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="epserve.bench.serve"):
        make_dataset("random", vocab_size=50, max_model_len=4096, num_prompts=5, random_input_len=10)
    assert not caplog.records


@pytest.mark.parametrize(("kwargs", "option"), [
    (dict(dataset="nope"), "--dataset"),
    (dict(num_prompts=0), "--num-prompts"),
    (dict(vocab_size=0), "--vocab-size"),
    (dict(random_input_len=0), "--random-input-len"),
    (dict(random_range_ratio=1.5), "--random-range-ratio"),
    (dict(dataset="shared-prefix", num_groups=0), "--num-groups"),
    (dict(dataset="shared-prefix", output_len=0), "--output-len"),
    (dict(dataset="shared-prefix", system_prompt_len=0, question_len=0), "--system-prompt-len"),
])
def test_dataset_validation_names_the_option(kwargs: dict[str, Any], option: str) -> None:
    kw: dict[str, Any] = dict(dataset="random", vocab_size=10, max_model_len=100)
    kw.update(kwargs)
    with pytest.raises(ValueError, match=option):
        make_dataset(kw.pop("dataset"), **kw)


# --------------------------------------------------------------------------------------------- arrivals


def test_poisson_delays() -> None:
    d = poisson_delays(20.0, 20000, seed=0)
    assert len(d) == 20000 and min(d) >= 0
    assert sum(d) / len(d) == pytest.approx(1 / 20.0, rel=0.03)
    var = sum((x - 0.05) ** 2 for x in d) / len(d)
    assert math.sqrt(var) == pytest.approx(0.05, rel=0.05)  # exponential: std == mean
    assert poisson_delays(20.0, 100, seed=1) == poisson_delays(20.0, 100, seed=1)
    assert poisson_delays(20.0, 100, seed=1) != poisson_delays(20.0, 100, seed=2)
    assert poisson_delays(math.inf, 5) == [0.0] * 5
    with pytest.raises(ValueError, match="--request-rate"):
        poisson_delays(0.0, 3)
    assert arrival_offsets([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    assert arrival_offsets([]) == []

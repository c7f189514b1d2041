"""Table 1's lexical metrics against values computed by hand (peerlm.agent.fedwave)."""

from __future__ import annotations

import math

import pytest
from peerlm.agent.fedwave.text_metrics import (
    METRIC_NAMES,
    corpus_scores,
    sentence_scores,
)

REF = "the cat sat on the mat"


def test_identical_texts_score_100_but_meteor_keeps_its_chunk_penalty() -> None:
    scores = sentence_scores("def f(x):\n    return x + 1\n", "def f(x):\n    return x + 1\n")
    # METEOR's penalty 0.5 * (chunks / matches)^3 never vanishes: one chunk of 10 tokens
    # (13a: def f ( x ) : return x + 1).
    expected = dict.fromkeys(METRIC_NAMES, 100.0) | {"meteor": 100 * (1 - 0.5 / 10**3)}
    assert scores.as_dict() == pytest.approx(expected)
    corpus = corpus_scores([REF, "a b c d"], [REF, "a b c d"])
    meteor = 100 * ((1 - 0.5 / 6**3) + (1 - 0.5 / 4**3)) / 2
    assert corpus.as_dict() == pytest.approx(
        dict.fromkeys(METRIC_NAMES, 100.0) | {"meteor": meteor}
    )


def test_rouge_of_a_prefix() -> None:
    # hyp "the cat sat": 3 of 6 reference unigrams, 2 of 5 bigrams, LCS 3; precision 1.
    scores = sentence_scores("the cat sat", REF)
    assert scores.rouge1 == pytest.approx(100 * 2 * 1 * 0.5 / 1.5)  # 66.67
    assert scores.rouge2 == pytest.approx(100 * 2 * 1 * 0.4 / 1.4)  # 57.14
    assert scores.rougeL == pytest.approx(100 * 2 * 1 * 0.5 / 1.5)


def test_bleu4_is_only_the_brevity_penalty_when_every_ngram_matches() -> None:
    # 5 of 6 words: all 1-4-gram precisions are 1, BP = exp(1 - 6/5).
    scores = corpus_scores(["the cat sat on the"], [REF])
    assert scores.bleu4 == pytest.approx(100 * math.exp(1 - 6 / 5), abs=1e-6)


def test_gleu_is_the_smaller_of_ngram_precision_and_recall() -> None:
    # hyp 1-4-grams: 5+4+3+2 = 14, all in the reference; reference has 6+5+4+3 = 18.
    assert sentence_scores("the cat sat on the", REF).gleu == pytest.approx(100 * 14 / 18)


def test_meteor_matches_stems_but_not_synonyms() -> None:
    # "cats" ~ "cat" by Porter stem: 3 matches, P = R = 1, one chunk: 1 - 0.5 * (1/3)^3.
    stemmed = sentence_scores("the cat sat", "the cats sat").meteor
    assert stemmed == pytest.approx(100 * (1 - 0.5 / 27))
    # "feline" ~ "cat" only through WordNet, which is not used: 2 matches in 2 chunks,
    # P = R = 2/3, fragmentation 1, penalty 0.5 -> 1/3.
    synonym = sentence_scores("the feline sat", "the cat sat").meteor
    assert synonym == pytest.approx(100 / 3)


def test_empty_and_disjoint_outputs_score_zero() -> None:
    for hyp in ("", "zebra quokka"):
        scores = sentence_scores(hyp, REF)
        assert scores.rouge1 == 0 and scores.meteor == 0 and scores.gleu == 0
        assert scores.bleu4 == pytest.approx(0.0, abs=1e-9)


def test_corpus_averages_rouge_and_meteor_and_pools_bleu() -> None:
    hyps, refs = ["the cat sat", "a b c d"], [REF, "a b c d"]
    corpus = corpus_scores(hyps, refs)
    one, two = sentence_scores(hyps[0], refs[0]), sentence_scores(hyps[1], refs[1])
    assert corpus.rouge1 == pytest.approx((one.rouge1 + two.rouge1) / 2)
    assert corpus.meteor == pytest.approx((one.meteor + two.meteor) / 2)
    # pooled 1-4-gram counts: 7/7, 5/5, 3/3, 1/1 matched; BP = exp(1 - 10/7)
    assert corpus.bleu4 == pytest.approx(100 * math.exp(1 - 10 / 7), abs=1e-6)


def test_corpus_refuses_mismatched_or_empty_input() -> None:
    with pytest.raises(ValueError, match="1 hypotheses but 2 references"):
        corpus_scores(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="no texts"):
        corpus_scores([], [])

"""Table 1's lexical metrics, from maintained packages: ROUGE-1/2/L, BLEU-4, GLEU, METEOR.

FedWave scores generated stage outputs against references with ROUGE-1/2/L (Lin 2004),
BLEU-4 (Papineni et al. 2002), GLEU (Wu et al. 2016), METEOR (Banerjee & Lavie 2005) and
BERTScore. None is written here by hand:

* **ROUGE-1/2/L** — Google's ``rouge-score`` (the reimplementation of ROUGE-1.5.5 that
  most papers report), F-measure, Porter stemming on. Its tokenizer lower-cases and keeps
  only letters and digits, so code punctuation does not count for ROUGE.
* **BLEU-4** — ``sacrebleu`` (its ``13a`` tokenizer, exponential smoothing for sentences).
  The corpus score is sacrebleu's corpus BLEU, not a mean of sentence scores.
* **GLEU** — NLTK's ``gleu_score`` (Google-BLEU of Wu et al. 2016, the paper's citation),
  on the same 13a tokens.
* **METEOR** — NLTK's ``meteor_score`` on the same 13a tokens (lower-cased by NLTK),
  **with exact and Porter-stem matching only**: its third stage, WordNet synonyms, needs the
  WordNet corpus, which NLTK downloads at run time and which cannot be fetched here (PyPI
  carries no maintained package of the English WordNet for NLTK; ``wn`` also downloads its
  data). :class:`NoSynonyms` stands in for the corpus reader and matches nothing. Scores
  are therefore a little lower than METEOR with WordNet on paraphrases, and equal on texts
  without synonyms — code and its templated docstrings have few. METEOR is a sentence
  metric; the corpus score is the mean of the sentence scores (as the paper's tooling,
  HuggingFace ``evaluate``, reports it).
* **BERTScore** is omitted: it needs a pretrained encoder (RoBERTa-large in the paper's
  setting) that cannot be downloaded here, and the tiny models' own encoders would give a
  number with the name but not the meaning. Table 1's ``BS-F`` column is left out.

All scores are on the paper's scale, 0-100.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from nltk.stem.porter import PorterStemmer
from nltk.translate.gleu_score import corpus_gleu, sentence_gleu
from nltk.translate.meteor_score import meteor_score
from rouge_score.rouge_scorer import RougeScorer
from sacrebleu.metrics.bleu import BLEU
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

__all__ = [
    "METRIC_NAMES",
    "NoSynonyms",
    "TextScores",
    "corpus_scores",
    "mean_sentence_scores",
    "sentence_score_columns",
    "sentence_scores",
]

_ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


class NoSynonyms:
    """A WordNet reader with no synsets: METEOR's synonym stage then matches nothing."""

    def synsets(self, lemma: str) -> list[object]:
        """No synonyms for any word."""
        return []


@dataclass(frozen=True)
class TextScores:
    """Table 1's lexical metrics (0-100) for one output or a corpus of outputs."""

    rouge1: float
    rouge2: float
    rougeL: float  # the metric's own name
    bleu4: float
    gleu: float
    meteor: float

    def as_dict(self) -> dict[str, float]:
        """The scores by metric name."""
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


#: The metric names, in :class:`TextScores` order.
METRIC_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TextScores))


def _tokens(text: str) -> list[str]:
    tokenized: str = Tokenizer13a()(text.strip())  # type: ignore[no-untyped-call]
    return tokenized.split()


def _rouge(hypothesis: str, reference: str) -> tuple[float, float, float]:
    scores = RougeScorer(list(_ROUGE_TYPES), use_stemmer=True).score(reference, hypothesis)
    r1, r2, rl = (100.0 * scores[t].fmeasure for t in _ROUGE_TYPES)
    return r1, r2, rl


def _meteor(hyp: list[str], ref: list[str]) -> float:
    if not hyp or not ref:  # NLTK divides by zero on an empty side
        return 0.0
    return 100.0 * float(
        meteor_score([ref], hyp, stemmer=PorterStemmer(), wordnet=NoSynonyms())  # type: ignore[arg-type]
    )


def sentence_scores(hypothesis: str, reference: str) -> TextScores:
    """All metrics of one generated text against its reference (for paired statistics)."""
    hyp, ref = _tokens(hypothesis), _tokens(reference)
    r1, r2, rl = _rouge(hypothesis, reference)
    bleu = BLEU(effective_order=True).sentence_score(hypothesis.strip(), [reference.strip()])
    gleu = 100.0 * float(sentence_gleu([ref], hyp)) if hyp and ref else 0.0
    return TextScores(r1, r2, rl, float(bleu.score), gleu, _meteor(hyp, ref))


def sentence_score_columns(
    hypotheses: Sequence[str], references: Sequence[str]
) -> dict[str, list[float]]:
    """Per metric (:data:`METRIC_NAMES`), the sentence score of each output against its
    reference: the units the workflow experiment's paired statistics run over."""
    rows = [sentence_scores(h, r).as_dict() for h, r in zip(hypotheses, references, strict=True)]
    return {m: [row[m] for row in rows] for m in METRIC_NAMES}


def mean_sentence_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Per metric, the mean sentence score over the outputs (the workflow experiment's
    per-strategy figure); ``ValueError`` when there is none."""
    if not hypotheses:
        raise ValueError("no texts to score")
    columns = sentence_score_columns(hypotheses, references)
    return {m: sum(v) / len(v) for m, v in columns.items()}


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> TextScores:
    """Corpus-level metrics: ROUGE and METEOR averaged, BLEU and GLEU pooled over n-grams.

    ``ValueError`` when the two lists differ in length or are empty.
    """
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    if not hypotheses:
        raise ValueError("no texts to score")
    n = len(hypotheses)
    rouge = [_rouge(h, r) for h, r in zip(hypotheses, references, strict=True)]
    hyp_tokens = [_tokens(h) for h in hypotheses]
    ref_tokens = [_tokens(r) for r in references]
    bleu = BLEU().corpus_score([h.strip() for h in hypotheses], [[r.strip() for r in references]])
    gleu = 100.0 * float(corpus_gleu([[r] for r in ref_tokens], hyp_tokens))
    meteor = sum(_meteor(h, r) for h, r in zip(hyp_tokens, ref_tokens, strict=True)) / n
    return TextScores(
        rouge1=sum(s[0] for s in rouge) / n,
        rouge2=sum(s[1] for s in rouge) / n,
        rougeL=sum(s[2] for s in rouge) / n,
        bleu4=float(bleu.score),
        gleu=gleu,
        meteor=meteor,
    )

"""Scores of decoded sequences against their references: exact match,
per-token accuracy, and BLEU as papers report it (sacrebleu on detokenised
text, Post 2018)."""

from collections.abc import Sequence

import sacrebleu


def exact_match(hypotheses: Sequence[Sequence[int]],
                references: Sequence[Sequence[int]]) -> float:
  """The fraction of hypotheses equal to their reference."""
  return sum(list(h) == list(r) for h, r in zip(hypotheses, references)) / max(
      len(references), 1)


def token_accuracy(hypotheses: Sequence[Sequence[int]],
                   references: Sequence[Sequence[int]]) -> float:
  """The fraction of reference tokens the hypothesis has at the same
  position (a missing position counts as wrong)."""
  right = sum(sum(a == b for a, b in zip(h, r))
              for h, r in zip(hypotheses, references))
  return right / max(sum(len(r) for r in references), 1)


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
  """Corpus BLEU of detokenised lines, sacrebleu's defaults (13a
  tokenisation, exponential smoothing), 0-100."""
  return sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score


def bleu_of_files(hypotheses_path: str, references_path: str) -> float:
  """`bleu` of two files of one line per sentence."""
  with open(hypotheses_path) as f:
    hypotheses = f.read().splitlines()
  with open(references_path) as f:
    references = f.read().splitlines()
  return bleu(hypotheses, references)

"""A brute-force reference for the length buckets of decoded examples."""


def recount(examples: list[dict], low: int, high: int) -> dict:
  """Brute force: each example's length counted up to its end token, each
  reference token compared with the hypothesis at its position."""
  count = exact = right = total = ratios = 0
  for example in examples:
    length = 0
    while example['inputs'][length] != 1:
      length += 1
    if not low <= length <= high:
      continue
    count += 1
    hypothesis, reference = example['hypothesis'], example['reference']
    exact += hypothesis == reference
    ratios += len(hypothesis) / len(reference)
    for i, token in enumerate(reference):
      total += 1
      right += i < len(hypothesis) and hypothesis[i] == token
  return {'lengths': f'{low}-{high}', 'examples': count,
          'exact_match': exact / count, 'token_accuracy': right / total,
          'length_ratio': ratios / count}

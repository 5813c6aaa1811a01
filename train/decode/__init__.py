"""Decoding from a trained model: greedy, sampled and beam-search decoding
with a key/value cache (decoding), a language model's text after a prompt
(text), and a sequence-to-sequence model's outputs scored against references
(seq2seq_eval, scores). Imports train.base and train.data."""

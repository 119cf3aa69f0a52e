"""Decoding: logits -> the probabilities a token is drawn from (`sampling`) and the autoregressive
baseline (`autoregressive`), the denominator of every speedup."""

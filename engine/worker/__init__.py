"""Running a scheduled batch: the model runner (weights, precision, KV pool sized and allocated, one forward per
step), its KV sizing rule, and the sampler."""

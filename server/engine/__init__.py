"""The one owner of a model's life: load a package into a served model (backend or refusal,
hash-checked export cache, proven padded shapes, warm-up, queues on the batcher, metric series),
swap versions without a gap, drain and release; the model repository and its control modes."""

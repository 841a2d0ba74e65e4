"""The kernels inside larger systems (chapters 11 and 12), through their public functions.

- :mod:`course_lib.integrations.ring`: ring attention (context parallelism) over ``torch.distributed``.
- :mod:`course_lib.integrations.tinylm`: a small Llama-style model whose attention is pluggable.
- :mod:`course_lib.integrations.hf`: Hugging Face transformers, ``register()`` makes the kernels
  an ``attn_implementation``.

Importing this package imports none of them (hf needs transformers installed).
"""

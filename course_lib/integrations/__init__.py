"""Adapters that plug the course's kernels into other libraries (chapter 12).

- :mod:`course_lib.integrations.hf`: Hugging Face transformers, ``register()`` makes the kernels
  an ``attn_implementation``.

Importing this package imports none of them (each needs its library installed).
"""

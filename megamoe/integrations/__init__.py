"""Adapters that put megamoe into training stacks: :mod:`.transformers` (Hugging Face
transformers 5.x, extra ``megamoe[hf]``) and :mod:`.torchtitan` (torchtitan 0.3.0, extra
``megamoe[torchtitan]``). Each imports its stack only when imported itself."""

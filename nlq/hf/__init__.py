"""Hugging Face interop (needs `transformers`, an optional dependency): the linear arm as a
plain GPT-2 (gpt2.py)."""

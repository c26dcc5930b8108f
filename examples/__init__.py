"""The examples, installed as ``qwen_absorb_examples`` (console script ``qwen-absorb-compare``: compare_outputs)."""

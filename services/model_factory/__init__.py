"""Makes small Qwen3-MoE models locally: a byte-level BPE tokenizer trained on a
generated code corpus, and randomly initialised weights in the HF layout, so the
same checkpoint loads in transformers, vLLM and the trainer (``etude model init``).
"""

"""Inference: one vLLM replica serving the current policy over gRPC.

Owns: the engine, generation (token ids in, token ids + logprobs + weight-version
spans out), and (later) in-flight weight updates and routed-expert capture.
Start it with ``python -m services.inference --config configs/local.toml`` or
``etude serve inference --config configs/local.toml``. vLLM is imported only
after the config is parsed.
"""

from services.config.inference import InferenceProcessConfig
from services.process import main

if __name__ == "__main__":
    raise SystemExit(main("inference", InferenceProcessConfig))

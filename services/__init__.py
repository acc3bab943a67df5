"""Etude: asynchronous RL for MoE coding agents, as five gRPC services.

Import root for every process: ``services.<svc>`` is one running process
(reconciler, envs, inference, trainer, evals); the modules beside them are the
code those processes share (wire plumbing, config, telemetry, the model factory).
"""

__version__ = "0.1.0"

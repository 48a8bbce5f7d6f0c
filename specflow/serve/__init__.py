"""OpenAI-compatible HTTP server: one engine thread with continuous batching behind FastAPI.

``specflow serve CONFIG`` runs it; ``build_app`` makes the ASGI app over an engine you built.
"""

from specflow.serve.app import RequestLimits, ServeConfig, build_app, load_serve_config, run_server

__all__ = ["RequestLimits", "ServeConfig", "build_app", "load_serve_config", "run_server"]

"""An OpenAI-compatible HTTP API in front of Tandem's text ensembles (FastAPI + uvicorn,
talking to Triton over tritonclient's asyncio gRPC stream).

- :mod:`.protocol`: the request and response bodies (pydantic), :class:`~.protocol.OpenAIError`
- :mod:`.ensemble_request`: an OpenAI request as the ensemble's input tensors
- :mod:`.triton_backend`: the gRPC stream to the ensemble
- :mod:`.chat_template`: chat messages as one prompt
- :mod:`.responses`: ensemble responses as OpenAI responses and SSE chunks
- :mod:`.app`: the routes (``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
  ``/health``, ``/metrics``)
- :mod:`.metrics`: the frontend's Prometheus metrics
- :mod:`.frontend`: :class:`~.frontend.OpenAIFrontend`, uvicorn in a thread (``tandem serve``)
"""

"""Simulated runtime of the local profile: test equipment with vLLM's OpenAI API on the wire.

It is not an engine. Run as `python3 -m sim` (standard library only), it checks the staged
model folder is complete, then answers like a vLLM OpenAI server (shapes from
vllm-project/vllm: chat_completion/protocol.py and serving.py, serve/engine/protocol.py,
generate/base/protocol.py, v1/metrics/loggers.py) with timing from a model set in the profile,
and keeps the server-side truth of every request.
"""

#!/usr/bin/env python
"""OpenAI-compatible server with tree speculative decoding, over either engine.

``python serve.py`` with no arguments serves the committed tiny model set
(``checkpoints/stdlib-v1``) with the default engine's default policy (fixed in code;
``--tree-from REPORT.json`` serves a benchmark's measured best; ``--tree auto`` chooses
the tree per step and request, its choices and predicted vs measured step seconds in
``/metrics``):
``--engine vllm`` (vLLM's own OpenAI server with the project's tree plugin) where vLLM
is installed, else ``--engine local`` (the project's engine). The server lives in
``tree_dev/server/``; ``docs/serve.md`` lists every flag, the vLLM / SGLang flag
mapping and the endpoints.
"""

from tree_dev.server import main

if __name__ == "__main__":
    main()

"""The decoder service: whole completions from the KV caches prefilled in the bubbles.

The main flow:

1. `__main__.py:main` -> `decoder.py:serve`: the model, the bus, the consumer of `DecodeRequest`s.
2. `decoder.py:Decoder.on_request`: load the prompt's KV cache (`Decoder._load`), or compute the
   prompt itself when it was placed here (`Decoder._compute`).
3. `decoder.py:Decoder._decode`: token by token (`Decoder._steps`), each `DecodeChunk` sent to the
   front door (`Decoder._send`); a failure answered explicitly (`Decoder._fail`).
4. `decoder.py:Decoder._free`: the KV cache's budget given back; `metrics.py:DecoderMetrics` counts.
"""

"""bubbletea-vllm: a vLLM KV connector for KV caches BubbleTea prefilled in training bubbles.

`bubbletea_vllm.connector` (needs vLLM) holds the connector; `handle`, `kvclient` and `layout`
need only the standard library, torch and safetensors.
"""

__version__ = "0.1.0"
#: What --kv-transfer-config names: {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE}.
CONNECTOR = "BubbleTeaConnector"
MODULE = "bubbletea_vllm.connector"

"""One small module per model architecture, each a `shared.model.causal.CausalLM`.

- `nanogpt`: the project's own GPT (`shared.model.gpt`), seeded or from a state_dict file.
- `gpt2`: Hugging Face GPT-2 (`model_type` gpt2).
- `llama`: the Llama family (`model_type` llama, mistral, qwen2).

Each Hugging Face family builds its modules from `config.json` (refusing, with the key named,
what it does not implement) and maps the checkpoint's tensor names to its own (`rename`);
`shared.model.checkpoint` does the loading and checking. Importing this package imports none of
the families (they need torch).
"""

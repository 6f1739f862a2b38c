"""A small GPT for pipeline-parallel training on CPU, and the models that serve prefill. Import the
submodule you need; this package imports none of them, so importing it never loads torch.

Without torch (safe for the HTTP front door and the dispatcher):

- `tokenizer`: the `Tokenizer` protocol, bytes (`ByteTokenizer`, `encode`, `decode`), a Hugging
  Face `tokenizer.json` (`HFTokenizer`), and the served model's (`tokenizer_for`).
- `shape`: the model's shape (`GPTConfig`), its stage split (`split_layers`, `stage_layer_ranges`),
  the KV-cache size of a prompt (`estimate_kv_bytes`), and the served model's shape (`model_info`:
  from a checkpoint directory's config.json, read by `shared.config.model_info`, or the spec).
- `calibration`: what the profiled operations really cost here, and the device time scale that
  keeps them (`calibrate`; it runs torch in processes of its own).

With torch:

- `gpt`: the model and its pipeline stages (`build_stage`, `build_full`, `lm_loss`, `make_optimizer`).
- `data`: the byte-level training corpus (`ByteCorpus`) and a `decode` that also takes a tensor.
- `causal`: the layer-by-layer `CausalLM` interface (`embed`, `block` with a KV cache, `head`).
- `families`: one module per architecture: `nanogpt` (the model above), `gpt2`, `llama` (llama,
  mistral, qwen2).
- `checkpoint`: Hugging Face checkpoint directories (safetensors) as a `CausalLM` (`load_causal_lm`).
- `prefill`: resumable prefill inference over any `CausalLM` (`PrefillModel`, `decode_step`,
  `sample`) and nanoGPT state_dict files.
- `reference`: the single-process reference trainer (`train_reference`).
- `seeds`: derived seeds and local generators.
- `lanes`: training's and prefill's CUDA streams (`Lane`).

`tests/unit/test_imports.py` checks that the services that need no tensors stay torch-free.
"""

"""A small GPT for pipeline-parallel training on CPU. Import the submodule you need; this package
imports none of them, so importing it never loads torch.

Without torch (safe for the HTTP front door and the dispatcher):

- `tokenizer`: text to byte ids and back (`encode`, `decode`, the `Tokenizer` protocol).
- `shape`: the model's shape (`GPTConfig`), its stage split (`split_layers`), and the KV-cache
  size of a prompt (`estimate_kv_bytes`).

With torch:

- `gpt`: the model and its pipeline stages (`build_stage`, `build_full`, `lm_loss`, `make_optimizer`).
- `data`: the byte-level training corpus (`ByteCorpus`) and a `decode` that also takes a tensor.
- `prefill`: resumable prefill inference (`PrefillModel`) and checkpoints.
- `reference`: the single-process reference trainer (`train_reference`).
- `seeds`: derived seeds and local generators.

`tests/unit/test_imports.py` checks that the services that need no tensors stay torch-free.
"""

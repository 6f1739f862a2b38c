"""BubbleTea's dispatcher: queued prefill requests into the training pipeline's bubbles."""

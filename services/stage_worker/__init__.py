"""One emulated GPU: a (DP replica, PP stage) slot of the training pipeline."""

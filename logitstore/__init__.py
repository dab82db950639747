"""logitstore: a versioned store of sparse teacher distributions for offline distillation."""

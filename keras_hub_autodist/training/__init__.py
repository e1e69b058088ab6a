"""Training a loaded model on its mesh: the bound model and its method table
(`binding`), batches checked against the batch axis (`batches`), optimizer
state on the mesh (`placement`), restores and resumable checkpoints, and when
training saves and stops (`stopping`, `global_random`)."""

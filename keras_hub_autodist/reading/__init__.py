"""Reading a preset: its config in the keras-free forms (a local folder, a
Hugging Face `config.json`, a dict), through keras-hub's loaders for
`hf://`, `kaggle://` and preset names, its dtypes, and the disk cache of
what was read. The first stage of the data path (docs/design.md)."""
